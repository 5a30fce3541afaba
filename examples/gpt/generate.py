"""A few tokens from a trained GPT example: the newest persistent checkpoint of a job, greedy
decoding from a prompt, one process on the CPU.

    python -m examples.gpt.generate --checkpoint run/demo/<time>/agents/checkpoints/<job> \\
        --tokenizer .cache/data/stdlib/tokenizer.json --prompt "def " -- <the job's program.args>
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from examples.gpt.model import ModelConfig
from examples.gpt.train import model_of, parse


def generate(checkpoint_root: str, model: ModelConfig, tokenizer_path: str, prompt: str, count: int = 24) -> str:
    """``count`` tokens that the newest good checkpoint under ``checkpoint_root`` continues
    ``prompt`` with (greedy), decoded."""
    import torch
    import torch.distributed as dist

    from examples.gpt import data
    from examples.gpt.model import model_provider
    from unicron.trainer import checkpoint
    from unicron.trainer.megatron_cpu import cpu_mode

    # isort: split
    from megatron.core import parallel_state, tensor_parallel

    tokenizer = data.Tokenizer(tokenizer_path)
    with tempfile.TemporaryDirectory() as store:
        dist.init_process_group("gloo", init_method=f"file://{store}/store", rank=0, world_size=1)
        try:
            with cpu_mode("cpu"):
                parallel_state.initialize_model_parallel(1, 1)
                tensor_parallel.model_parallel_cuda_manual_seed(0)
                gpt = model_provider(model)(True, True)
                layout = checkpoint.layout_of_config(model.shape(), 1, 1)
                found = checkpoint.find_latest(checkpoint_root, layout, 0, 0)
                if found is None:
                    raise ValueError(f"no usable checkpoint under {checkpoint_root}")
                _, payload = found
                gpt.load_state_dict(payload["model"], strict=True)
                gpt.eval()
                ids = tokenizer.encode(prompt)[-model.seq_length :] or [tokenizer.eod]
                made: list[int] = []
                with torch.no_grad():
                    for _ in range(count):
                        window = (ids + made)[-model.seq_length :]
                        tokens = torch.tensor([window])
                        positions = torch.arange(len(window)).unsqueeze(0)
                        logits = gpt(tokens, positions, None)
                        made.append(int(logits[0, -1].argmax()))
                parallel_state.destroy_model_parallel()
        finally:
            dist.destroy_process_group()
    return tokenizer.decode(made)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="examples.gpt.generate", description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True, help="the job's checkpoint directory")
    parser.add_argument("--tokenizer", required=True, help="tokenizer.json of the job's data")
    parser.add_argument("--prompt", default="def ", help="text to continue (default 'def ')")
    parser.add_argument("--tokens", type=int, default=24, help="tokens to generate (default 24)")
    parser.add_argument("program_args", nargs="*", help="the job's program.args (its model shape)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if not Path(args.checkpoint).is_dir():
        print(f"generate: no checkpoint directory {args.checkpoint}", file=sys.stderr)
        return 2
    try:
        text = generate(args.checkpoint, model_of(parse(args.program_args)), args.tokenizer, args.prompt, args.tokens)
    except ValueError as exc:
        print(f"generate: {exc}", file=sys.stderr)
        return 1
    print(f"{args.prompt}{text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
