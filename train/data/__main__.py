"""`python -m train.data prepare INPUTS... --tokenizer TOK --out DIR` (see
train/data/prepare.py)."""

import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in ("prepare",):
        print(
            "usage: python -m train.data prepare INPUTS... --tokenizer TOK --out DIR  (prepare"
            " --help for more)",
            file=sys.stderr,
        )
        return 2
    from train.data.prepare import main as prepare_main

    return prepare_main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
