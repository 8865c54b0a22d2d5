"""`python -m train.harness [run] ARGS`: lm_eval's own command line with the "brigade" model
(train/cli/harness.py) registered and chosen unless --model names another; lm_eval's errors for
bad input end in one line."""

from __future__ import annotations

import re
import sys

from errors import UserError, one_line_errors
from train.cli import harness


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    """lm_eval's command line with the "brigade" model registered (and chosen unless --model
    says)."""
    if harness.register_model is None:
        raise UserError("harness: lm-evaluation-harness is not installed; pip install -e '.[eval]'")
    from lm_eval.__main__ import cli_evaluate

    argv = list(sys.argv[1:] if argv is None else argv)
    # lm_eval's subcommand, implied when none is given
    run = argv[:1] if argv[:1] == ["run"] else []
    if (
        argv
        and not any(a in ("--model", "-M") or a.startswith("--model=") for a in argv)
        and argv[0] not in ("ls", "validate", "-h", "--help")
    ):
        argv = [*run, "--model", "brigade", *argv[len(run) :]]
    saved, sys.argv = sys.argv, ["lm-eval", *argv]  # lm_eval's parser reads sys.argv itself
    try:
        cli_evaluate()
    except SystemExit as e:  # argparse's --help and errors
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    except UserError:
        raise
    # lm_eval's word for bad input (an unknown task, a malformed arg): one line
    except ValueError as e:
        raise UserError(
            f"lm_eval: {(str(e).strip().splitlines() or [type(e).__name__])[0]}"
        ) from None
    # lm_eval passes its flags --batch_size, --device, ... to the model as well
    except TypeError as e:
        twice = re.search(r"multiple values for keyword argument '(\w+)'", str(e))
        if not twice:
            raise
        raise UserError(
            f"harness: model arg {twice[1]} is also lm_eval's flag --{twice[1]}; give it there"
        ) from None
    finally:
        sys.argv = saved
    return 0
