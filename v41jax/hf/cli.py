"""The `import-hf` and `export-hf` commands (their parsers; the work is `v41jax.hf.workdir`).
Imports nothing heavy at module level: `python -m v41jax --help` stays fast."""

from __future__ import annotations

import argparse
import json


def cmd_import_hf(args) -> int:
    from v41jax.hf.checkpoint import check_hf_dir
    from v41jax.hf.workdir import import_hf

    # the directory, its config.json and its safetensors headers first: a missing or damaged
    # one is named as such, not as the missing tokenizer.json import_hf looks for first
    check_hf_dir(args.hf_dir)
    print(json.dumps(import_hf(args.hf_dir, args.workdir, args.config, args.overrides), indent=2))
    return 0


def cmd_export_hf(args) -> int:
    from v41jax.hf.convert import FAMILIES
    from v41jax.hf.workdir import export_hf

    if args.family not in FAMILIES:
        raise ValueError(f"--family {args.family!r}: one of {', '.join(FAMILIES)}")
    files = export_hf(args.workdir, args.out, args.family, args.step)
    print(json.dumps({"out": args.out, "files": files}, indent=2))
    return 0


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "import-hf", help="a Hugging Face model directory (Llama/Mistral/Qwen2/Qwen3) as a workdir"
    )
    p.add_argument("hf_dir", help="config.json + safetensors (+ tokenizer.json)")
    p.add_argument("--workdir", required=True, help="a new workdir")
    p.add_argument(
        "--config",
        default="small",
        help="named config for data/train settings (the model is DIR's)",
    )
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a field, e.g. --set model.max_seq_len=4096",
    )
    p.set_defaults(func=cmd_import_hf)
    p = sub.add_parser("export-hf", help="a workdir's model as a Hugging Face model directory")
    p.add_argument("--workdir", required=True)
    p.add_argument("--out", required=True, help="a new directory")
    p.add_argument("--family", required=True, help="llama, mistral, qwen2 or qwen3")
    p.add_argument("--step", type=int, help="checkpoint step (default: the latest)")
    p.set_defaults(func=cmd_export_hf)
