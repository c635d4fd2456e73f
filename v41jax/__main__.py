"""Command line: `python -m v41jax {train,prepare-data,eval,generate,train-drafter,...} ...`.

    python -m v41jax train --config tiny --workdir runs/tiny --set train.steps=24
    python -m v41jax prepare-data --config tiny --out data/tiny  # then --set data.token_dir=...
    python -m v41jax eval --workdir runs/tiny
    python -m v41jax generate --workdir runs/tiny --prompt "The state of the Union"
    python -m v41jax train-drafter --target-workdir runs/tiny --workdir runs/tiny_drafter
    python -m v41jax generate --workdir runs/tiny --drafter runs/tiny_drafter --schedule scheduled
    python -m v41jax bench train --json bench.json
    python -m v41jax plan --config 1b --mesh data=1,fsdp=8,tensor=1 --platform tpu  # will it fit?
    python -m v41jax sweep experiments/engram_vs_ffn/config.py --setting mini
    python -m v41jax report experiments/engram_vs_ffn
    python -m v41jax import-hf path/to/Qwen3-0.6B --workdir runs/qwen3  # then eval, generate ...
    python -m v41jax export-hf --workdir runs/qwen3 --out exported/ --family qwen3

`--config` is a named config (`v41jax/configs/<name>.py`) or a path to a Python file with
`get_config()`; each `--set section.field=value` overrides one field, parsed by its type.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from v41jax import config as config_lib
from v41jax.hf import cli as hf_cli


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config",
        default=None,
        help=f"named config {config_lib.named_configs()}, a path to a .py with get_config(), "
        "or a run's config.json (default: the --workdir's own config.json when it holds a "
        "run, else small)",
    )
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one config field, e.g. --set train.steps=100 (repeatable)",
    )


def _load_config(args) -> config_lib.Config:
    name = args.config
    if name is None:  # resume a run from its own config; a new run defaults to `small`
        from v41jax.train.workdir import as_path, load_config

        saved = as_path(args.workdir) / "config.json"  # any epath workdir (gs://...)
        if saved.exists():
            return config_lib.override(load_config(saved), args.overrides)
        print("no --config: training the `small` config", file=sys.stderr)
        name = "small"
    return config_lib.override(config_lib.get_config(name), args.overrides)


def cmd_train(args) -> int:
    from v41jax.train import train
    from v41jax.train.workdir_kind import require_kind

    require_kind(args.workdir, "train")  # before its config.json is read as a run's
    cfg = _load_config(args)
    result = train(cfg, args.workdir, progress=not args.no_progress)
    print(json.dumps(result, indent=2))
    return 0


def cmd_prepare_data(args) -> int:
    from v41jax.data import Tokenizer, write_token_dir
    from v41jax.train.workdir_kind import require_kind

    require_kind(args.out, "prepare-data")  # a new or empty folder, before the corpus is read
    cfg = config_lib.override(config_lib.get_config(args.config or "small"), args.overrides)
    tokenizer = Tokenizer.load(args.tokenizer) if args.tokenizer else None
    out = write_token_dir(cfg, args.out, tokenizer=tokenizer, show_progress=not args.no_progress)
    print(json.dumps({k: out[k] for k in ("dtype", "tokenizer_sha256", "splits")}, indent=2))
    return 0


def cmd_eval(args) -> int:
    from v41jax.train import evaluate_run

    print(json.dumps(evaluate_run(args.workdir, args.batches), indent=2))
    return 0


def cmd_generate(args) -> int:
    import jax
    import numpy as np

    from v41jax.decode import SamplingParams, generate
    from v41jax.train import load_run

    run = load_run(args.workdir)
    g = run.cfg.generate
    max_new = args.max_new_tokens if args.max_new_tokens is not None else g.max_new_tokens
    temperature = args.temperature if args.temperature is not None else g.temperature
    top_k = args.top_k if args.top_k is not None else g.top_k
    top_p = args.top_p if args.top_p is not None else g.top_p
    min_p = args.min_p if args.min_p is not None else g.min_p
    seed = args.seed if args.seed is not None else g.seed
    prompts = args.prompt or [""]
    # Each prompt starts as the model's documents do: after the separator (eos) for a v41jax
    # run, with its tokenizer's template (Llama's BOS, Qwen's nothing) for an imported model.
    encoded = [run.tokenizer.prompt_ids(p) for p in prompts]
    lengths = np.array([len(e) for e in encoded], np.int32)
    padded = np.zeros((len(encoded), int(lengths.max())), np.int32)
    for i, e in enumerate(encoded):
        padded[i, : len(e)] = e
    sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    if args.drafter:
        from v41jax.dspark.cli import generate_with_drafter

        out = generate_with_drafter(args, run, padded, lengths, max_new, sampling, seed)
    else:
        out = generate(
            run.params,
            run.cfg.model,
            padded,
            lengths,
            max_new_tokens=max_new,
            rng=jax.random.PRNGKey(seed),
            eos_id=run.tokenizer.eos_id,
            compression=run.compression.table,
            sampling=sampling,
        )
    for prompt, row in zip(prompts, np.asarray(out), strict=True):
        ids = [int(t) for t in row]
        if run.tokenizer.eos_id in ids:
            ids = ids[: ids.index(run.tokenizer.eos_id)]
        print(f"--- step {run.step} | {prompt!r}")
        print(prompt + run.tokenizer.decode(ids))
    return 0


def cmd_train_drafter(args) -> int:
    from v41jax.dspark.train.config import DrafterRunConfig, override_run_config
    from v41jax.dspark.train.loop import train_drafter
    from v41jax.dspark.train.record import load_drafter_config

    try:  # resuming: start from the saved config, so the same command continues the run
        base = load_drafter_config(args.workdir)[0]
    except FileNotFoundError:
        base = DrafterRunConfig()
    cfg = override_run_config(base, args.overrides)
    result = train_drafter(
        cfg,
        args.target_workdir,
        args.workdir,
        init_from=args.init_from,
        progress=not args.no_progress,
    )
    print(json.dumps(result, indent=2))
    return 0


def cmd_sweep(args) -> int:
    from v41jax.sweep import default_runs_dir, is_done, load_sweep, record_setting, run_sweep
    from v41jax.sweep.driver import check_workdir_config

    specs = load_sweep(args.sweep_file, args.setting, args.overrides)
    runs_dir = args.runs_dir or default_runs_dir(args.sweep_file, args.setting)
    if args.list:
        for s in specs:
            try:
                state = "done" if is_done(s, s.workdir(runs_dir)) else "todo"
            except ValueError:  # a finished run of another config: the sweep would refuse it
                state = "differs"
            print(f"{state:8s}{s.workdir(runs_dir)}  {json.dumps(dict(s.meta))}")
        return 0
    for s in specs:  # nothing is written before every run dir is known to agree
        check_workdir_config(s, s.workdir(runs_dir))
    record_setting(runs_dir, args.sweep_file, args.setting)
    out = run_sweep(specs, runs_dir, progress=not args.no_progress, limit=args.limit)
    print(json.dumps({k: len(v) if isinstance(v, list) else v for k, v in out.items()}))
    if out["stopped"]:
        print("sweep stopped by a signal; rerun the same command to continue", file=sys.stderr)
        return 1
    return 0


def cmd_report(args) -> int:
    from v41jax.sweep import experiment_dirs, recorded_setting, write_report

    if not os.path.isdir(args.experiment_dir):
        raise FileNotFoundError(f"experiment folder {args.experiment_dir!r} does not exist")
    setting = args.setting or (recorded_setting(args.runs_dir) if args.runs_dir else None)
    setting = setting or "full"
    runs_dir, out_dir = experiment_dirs(args.experiment_dir, setting, args.runs_dir, args.out_dir)
    if not os.path.isdir(runs_dir):
        raise FileNotFoundError(f"no runs in {runs_dir!r} (setting {setting}); run the sweep")
    if (found := recorded_setting(runs_dir)) not in (None, setting):
        raise ValueError(f"{runs_dir} holds the runs of setting {found!r}, not {setting!r}")
    written = write_report(
        args.experiment_dir, runs_dir, out_dir=out_dir, setting=setting, echo=not args.quiet
    )
    print(json.dumps(written, indent=2), file=sys.stderr)
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse, plus a hint when a config field is given as an option (`--steps 24`)."""

    def error(self, message: str):
        hint = _option_hint(message)
        super().error(f"{message}{hint}")


def _option_hint(message: str) -> str:
    if "unrecognized arguments" not in message:
        return ""
    from v41jax.dspark.train.config import DrafterRunConfig

    leaves = set()
    for tree in (config_lib.to_dict(config_lib.Config()), config_lib.to_dict(DrafterRunConfig())):
        stack = [("", tree)]
        while stack:
            prefix, node = stack.pop()
            for k, v in node.items():
                if isinstance(v, dict):
                    stack.append((f"{prefix}{k}.", v))
                else:
                    leaves.add(f"{prefix}{k}")
    words = message.split(":", 1)[1].split()
    hints = []
    for i, word in enumerate(words):
        if not word.startswith("--"):
            continue
        name = word[2:].split("=", 1)[0].replace("-", "_")
        value = word.split("=", 1)[1] if "=" in word else None
        if value is None and i + 1 < len(words) and not words[i + 1].startswith("--"):
            value = words[i + 1]
        for key in sorted(k for k in leaves if k.rsplit(".", 1)[-1] == name):
            hints.append(f"--set {key}={value if value is not None else 'VALUE'}")
    if not hints:
        return "\nconfig fields are set with --set section.field=value (see --help)"
    return "\nconfig fields are set with --set: did you mean " + " or ".join(hints) + "?"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="python -m v41jax",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("train", help="train (or resume) a model in --workdir")
    _add_config_args(p)
    p.add_argument("--workdir", required=True)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("prepare-data", help="tokenize the corpus once into a token-file folder")
    _add_config_args(p)  # without --config: small
    p.add_argument("--out", required=True, help="a new folder; train with data.token_dir=OUT")
    p.add_argument("--tokenizer", help="a tokenizer.json to use (e.g. a run's, to fine-tune it)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_prepare_data)

    p = sub.add_parser("eval", help="validation loss of the latest checkpoint in --workdir")
    p.add_argument("--workdir", required=True)
    p.add_argument(
        "--batches",
        type=int,
        default=None,
        help="validation batches (default: the run's train.eval_batches)",
    )
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("generate", help="sample text from the model in --workdir")
    p.add_argument("--workdir", required=True)
    p.add_argument("--prompt", action="append", help="prompt text (repeat for a batch)")
    p.add_argument("--max-new-tokens", type=int)
    p.add_argument("--temperature", type=float, help="0 = greedy")
    p.add_argument("--top-k", type=int)
    p.add_argument("--top-p", type=float)
    p.add_argument("--min-p", type=float)
    p.add_argument("--seed", type=int)
    p.add_argument("--drafter", help="a train-drafter workdir: DSpark speculative decoding")
    p.add_argument(
        "--schedule",
        choices=("fixed", "scheduled"),
        default="scheduled",
        help="with --drafter: verify lengths fixed or chosen from confidence",
    )
    p.add_argument("--verify-len", type=int, help="with --schedule fixed (default: block size)")
    p.add_argument(
        "--verify",
        choices=("padded", "ragged"),
        default="padded",
        help="with --drafter: one verify width for the batch (padded) or each row its own "
        "length in one packed target call (ragged)",
    )
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser(
        "train-drafter", help="train (or resume) a DSpark drafter on a frozen target run"
    )
    p.add_argument("--target-workdir", required=True, help="the trained target's workdir")
    p.add_argument("--workdir", required=True)
    p.add_argument("--init-from", help="start from this drafter workdir's params (realignment)")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="e.g. --set drafter.block_size=7 --set train.steps=400",
    )
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=cmd_train_drafter)

    # listed here; `main` hands its arguments to v41jax.bench (`bench --help` lists them)
    sub.add_parser("bench", help="benchmarks: python -m v41jax bench --help lists them")

    # listed here; `main` hands its arguments to v41jax.train.plan_cli's own parser
    sub.add_parser("plan", help="will it fit? per-device bytes, FLOPs, MFU bound (plan --help)")

    p = sub.add_parser(
        "sweep", help="run (or continue) a sweep file's grid: each run in its own workdir"
    )
    p.add_argument("sweep_file", help="a .py with get_sweep(setting) -> list[RunSpec]")
    p.add_argument("--setting", default="full", help="the grid's size (default: full)")
    p.add_argument(
        "--runs-dir",
        help="where the runs go (default: runs/<the sweep file's folder name>, with "
        "_<setting> appended for any setting but full)",
    )
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one config field in every run, e.g. --set data.paths=texts/",
    )
    p.add_argument("--limit", type=int, help="train at most this many runs, then stop")
    p.add_argument("--list", action="store_true", help="print the runs and exit")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_sweep)

    p = sub.add_parser(
        "report", help="results/summary.json, tables.md and plots of an experiment's runs"
    )
    p.add_argument("experiment_dir", help="e.g. experiments/engram_vs_ffn")
    p.add_argument(
        "--setting",
        help="the sweep's setting (default: the one recorded in --runs-dir, else full); "
        "only full writes the experiment's results/ by default",
    )
    p.add_argument("--runs-dir", help="default: runs/<experiment folder name>[_<setting>]")
    p.add_argument(
        "--out-dir", help="default: <experiment>/results for full, else <runs-dir>/results"
    )
    p.add_argument("--quiet", action="store_true", help="do not print the tables")
    p.set_defaults(func=cmd_report)
    hf_cli.add_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["plan"]:  # its parser loads jax and the train stack: only when asked
        from v41jax.train.plan_cli import main as plan_main

        return plan_main(argv)
    if argv[:1] == ["bench"]:  # its own dispatch: `bench --help` lists the benchmarks
        from v41jax.bench.__main__ import main as bench_main

        return bench_main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, KeyError, FileNotFoundError, FileExistsError) as e:
        # Config and input errors: one clear line, not a traceback.
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"error: {msg}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
