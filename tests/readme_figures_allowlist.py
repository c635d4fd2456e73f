"""Decimal figures in experiments/*/README.md prose that the committed results do not hold
verbatim, each with its source (`tests/test_readme_figures.py`, prose section).

A source that starts with a committed file's path and a colon is checked against that file;
the others are derived figures (a ratio or a difference of two values of the experiment's
JSON, named here), figures of an earlier commit's JSON (`git show COMMIT:PATH`), config
values, or figures from outside this repository. Keep this list short: a figure that the
experiment's report.py can render belongs in its tables.md instead.
"""

_DSPARK_6071D72 = "git show 6071d72:experiments/dspark/results/summary.json"
_DSPARK_8900504 = "git show 8900504:experiments/dspark/results/summary.json"

ALLOWED: dict[str, dict[str, str]] = {
    "dspark_load": {
        "1.7": "experiments/dspark_deep/results/summary.json: cost_units.dspark.32.round[5], "
        "a round verifying K = 5 drafts in plain rounds (1.72)",
        "0.5": "config value: OPEN_RATES",
        "0.9": "config value: OPEN_RATES",
    },
    "benchmarks": {
        "7.8": "extrapolation: the 5e8 FFN row's 7,596 us/token x 4 x 256 tokens (engram.json)",
        "1.97": "ratio: HostTable 2 threads / 1 thread, 2.498 / 1.267 GB/s (engram.json)",
        "10.8": "experiments/benchmarks/mhc.json: vmem_limit_bytes, in MiB",
        "6.7": "outside: the mHC paper's (arXiv 2512.24880) overhead in training time",
        "4.5": "ratio: reference / blockwise at T = 4,096, 2,533 / 563 ms (attention.json); "
        "and the issue's target for temp(4096) / temp(1024)",
        "2.7": "ratio: reference / blockwise at T = 1,024, 144 / 53.3 ms (attention.json)",
        "2.9": "ratio: unrolled / scanned total seconds at 32 layers, 28.4 / 9.89 (compile.json)",
        "1.53": "ratio: 36 GiB / ram_gib 23.54 (table_file.json)",
    },
    "dspark": {
        "70.2": _DSPARK_6071D72 + ": scheduler_study.cost_table (s), in ms",
        "73.4": _DSPARK_6071D72 + ": scheduler_study.cost_table (s), in ms",
        "72.2": _DSPARK_6071D72 + ": scheduler_study.cost_table (s), in ms",
        "79.2": _DSPARK_6071D72 + ": scheduler_study.cost_table (s), in ms",
        "73.5": _DSPARK_6071D72 + ": scheduler_study.cost_table (s), in ms",
        "0.853": _DSPARK_6071D72 + ": scheduled / fixed L=3 median tokens/s, 922.3 / 1081.3",
        "4.994": _DSPARK_6071D72 + ": scheduler_study scheduled mean_verify_len",
        "2.643": _DSPARK_8900504 + ": dspark tokens_per_round",
        "1.795": _DSPARK_8900504 + ": mtp1 tokens_per_round",
        "2.542": _DSPARK_8900504 + ": dspark_corpus tokens_per_round",
        "1.47": "ratio: 2.643 / 1.795, " + _DSPARK_8900504,
    },
    "dspark_deep": {
        "0.98": "experiments/dspark/results/tables.md: dspark fixed vs plain, batch 8",
        "1.12": "experiments/dspark/results/tables.md: mtp1 fixed vs plain, batch 32",
        "0.19": "difference: stats acceptance at positions 2-5, dspark - parallel: 0.19-0.27",
        "0.27": "difference: stats acceptance at positions 2-5, dspark - parallel: 0.19-0.27",
        "0.12": "difference: stats acceptance at positions 2-5, dspark_r256 - dspark: 0.12-0.15",
        "6.17": "outside: the DSpark paper's tokens per round (Qwen3-8B target, block 7)",
    },
    "engram_scale": {
        "23.5": "experiments/benchmarks/table_file.json: ram_gib, this machine's RAM",
        "1.58": "ratio: 40e9 B / (23.54 x 2^30 B), RAM from benchmarks/table_file.json ram_gib",
        "1.04": "experiments/benchmarks/results/tables.md: rowwise_adagrad 1e9 vs 1e6 "
        "(tables_rowwise_1e9.json)",
        "0.95": "config: Adam's b2 (v41jax/config/schema.py, OptimConfig.b2)",
    },
    "engram_vs_ffn": {
        "2601.07372": "the Engram paper's arXiv id, not a figure",
        "1.25": "config.py, setting large (not run): MoE capacity factor",
        "2.84": "ratio: ffn_2M / baseline step_s at seed 0, 0.737 / 0.259 (summary.json)",
        "0.30": "difference: rho 1.0 minus rho 0.0 mean val loss, 4.2570 - 3.9611 (tables.md)",
        "0.212": "difference: rho 1.0 minus rho 0.75 mean val loss, 4.2570 - 4.0448",
        "0.029": "difference: rho 0.25 minus rho 0.0 mean val loss, 3.9897 - 3.9611",
        "0.0006": "difference: rho 0.25's min minus rho 0.0's max val loss, 3.9711 - 3.9705",
        "0.79": "difference: FFN minus Engram on continuations, 3.0170 - 2.2312 (study3.json)",
        "0.005": "difference: smallest max - min val loss over an arm's seeds (summary.json)",
        "0.063": "difference: largest max - min val loss over an arm's seeds (summary.json)",
        "1.7248": "outside: the Engram paper, allocation law at ~10 B (pure MoE)",
        "1.7109": "outside: the Engram paper, allocation law at ~10 B (best rho)",
        "1.634": "outside: the Engram paper, MoE-27B val loss",
        "1.622": "outside: the Engram paper, Engram-27B val loss",
    },
    "mhc_stability": {
        "2.23": "v41jax.model.param_accounting(get_config('baseline').model) of config.py: "
        "total_params 2,230,400",
        "2.44": "v41jax.model.param_accounting(get_config('mhc').model) of config.py: "
        "total_params 2,435,632 (hc the same)",
        "0.50": "difference: baseline seed 0 minus seed 1 val loss, 5.505 - 5.010 (summary.json)",
    },
    "quickstart": {
        "4.724": "experiments/spec_throughput/results/summary.json: real.target_eval.val_loss",
    },
}
