"""`python -m train sample CKPT --prompt TEXT [--chat] [--max-new N] [--temperature T] [--top-k K]
[--seed S] [--tokenizer SPEC]`: a checkpoint's model continues a prompt (models/sample.py, with
its KV cache) and the new text is printed, up to the tokenizer's end-of-document token.

CKPT and every run flag (--mesh, --model.dtype, ...) are as for `eval` (train/cli/evaluate.py). The
tokenizer is the one the checkpoint records (the training data's, or the model directory of an
HF import), else the byte tokenizer; --tokenizer SPEC overrides it. --chat renders the prompt as
one user message with the model directory's chat template and the assistant's generation prompt,
as `prepare --format chat` renders training conversations (train/data/chat.py). --temperature 0
is greedy; --seed picks the random draws otherwise (the same seed, the same text).
"""

from __future__ import annotations

import jax
import numpy as np

from errors import UserError, number, one_line_errors
from models import model
from train.cli.checkpoint_model import checkpoint_tokenizer, command_parser, open_model
from train.core.inference import generate_on_mesh
from train.data import chat, tokenizers


def prompt_ids(tok: tokenizers.Tokenizer, prompt: str, as_chat: bool) -> np.ndarray:
    """The prompt's token ids [T0]: the text itself, or (--chat) one user message rendered with
    the chat template and the generation prompt."""
    if as_chat:
        if not tok.chat_template:
            raise UserError(
                f"sample: --chat: the tokenizer ({tok.model_dir or tok.path or tok.kind}) has no"
                " chat template (a HuggingFace model directory's chat_template.jinja or"
                " tokenizer_config.json holds one); drop --chat, or give --tokenizer HF_MODEL_DIR"
            )
        prompt = chat.render(
            tok, [{"role": "user", "content": prompt}], add_generation_prompt=True, where="--prompt"
        )
    ids = tok.encode([prompt])[0]
    if not len(ids):
        raise UserError("sample: --prompt: empty; give the text to continue")
    return ids


def _check_prompt(ns, ids: np.ndarray, cfg) -> None:
    """The prompt's length and ids against the model, before its parameters are read."""
    m = cfg.model
    if len(ids) + ns.max_new > m.max_seq_len:
        raise UserError(
            f"sample: the prompt's {len(ids)} tokens + --max-new {ns.max_new} exceed the model's"
            f" max_seq_len {m.max_seq_len}; shorten one"
        )
    if int(ids.max()) >= m.vocab_size:
        raise UserError(
            f"sample: the prompt holds token id {int(ids.max())}, beyond the model's vocab_size"
            f" {m.vocab_size}: the tokenizer is not the model's; give its own with --tokenizer SPEC"
        )
    if not model.decodes(m):
        raise UserError(
            f"sample: model '{cfg.model_preset}' has no decoding cache (init_cache), so it cannot"
            " generate"
        )


def make_sample_parser():
    parser = command_parser(
        "python -m train sample", "Continue a prompt with a checkpoint's model."
    )
    parser.add_argument(
        "--prompt", required=True, help="the text to continue (with --chat: the user's message)"
    )
    parser.add_argument(
        "--chat", action="store_true", help="wrap the prompt in the model directory's chat template"
    )
    parser.add_argument(
        "--max-new", type=number(int, ">=1"), default=128, metavar="N", help="tokens to generate"
    )
    parser.add_argument(
        "--temperature", type=number(float, ">=0"), default=0.8, metavar="T", help="0 = greedy"
    )
    parser.add_argument(
        "--top-k",
        type=number(int, ">=0"),
        default=40,
        metavar="K",
        help="sample among the K likeliest; 0 = all",
    )
    parser.add_argument(
        "--tokenizer",
        default="",
        metavar="SPEC",
        help="byte, KIND:PATH or an HF model directory (default: the one the checkpoint records)",
    )
    return parser


@one_line_errors
def main(argv: list[str]) -> int:
    """Prints the generated text (only the new tokens); --seed is the run flag (train.seed)."""
    ns = make_sample_parser().parse_args(argv)
    opened = open_model(ns.ckpt, ns)
    tok = checkpoint_tokenizer(ns.tokenizer, opened.meta)
    ids = prompt_ids(tok, ns.prompt, ns.chat)
    _check_prompt(ns, ids, opened.cfg)
    s = opened.setup()
    out_BN = generate_on_mesh(
        s,
        opened.params(s),
        ids[None, :].astype(np.int32),
        jax.random.key(opened.cfg.train.seed),
        max_new=ns.max_new,
        temperature=ns.temperature,
        top_k=ns.top_k,
    )
    new = [int(i) for i in np.asarray(jax.device_get(out_BN))[0]]
    if tok.eos_id in new:  # the end of the document: what follows is a new one
        new = new[: new.index(tok.eos_id)]
    if jax.process_index() == 0:
        print(tok.decode(new), flush=True)
    return 0
