"""The README's summary table of the plans in this folder: `python experiments/plan/table.py`."""

import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))
ORDER = [
    "1b_tpu",
    "1b_tpu_blockwise",
    "1b-engram_tpu_blockwise",
    "1b-mhc_tpu_blockwise",
    "8b_cuda",
    "8b-engram_cuda",
    "8b-mhc_cuda",
    "1b-engram_tpu_nomicro",
    "1b-mhc_tpu_nomicro",
    "8b-engram_cuda_nomicro",
    "8b-mhc_cuda_nomicro",
    "1b_tpu_unscanned",
    "1b_tpu_unscanned_noremat",
    "1b_tpu_full_logits",
]
GIB = 1 << 30


def row(name: str) -> str:
    with open(os.path.join(HERE, f"{name}.json")) as f:
        r = json.load(f)
    b, s, low = r["bytes_per_device"], r["settings"], r["target_lowering"]
    if low.get("skipped"):
        lowers = "not tried"
    else:
        lowers = "yes" if low["ok"] else "**no**: " + low["error"].split("(")[0]
    return (
        f"| `{name}` | {r['params'] / 1e9:.3f}B | {r['global_batch'][0]} x "
        f"{r['global_batch'][1]} / {s['microbatches']} | {b['params'] / GIB:.2f} | "
        f"{b['optimizer_state'] / GIB:.2f} | {b['temporaries'] / GIB:.2f} | "
        f"**{b['peak'] / GIB:.2f}** / {r['device_memory'] / GIB:.0f} | "
        f"{'yes' if r['fits'] else '**no**'} | {100 * r['mfu_bound']:.1f}% | "
        f"{r['step_seconds_at_peak']:.2f} s | {r['platform']}: {lowers} | "
        f"{r['compile_seconds']:.0f} s |"
    )


def main() -> None:
    print(
        "| plan | params | batch x T / microbatches | params GiB | optimizer GiB | "
        "temporaries GiB | peak / memory GiB | fits | MFU bound | step at peak | lowers | "
        "compile |"
    )
    print("|" + " --- |" * 12)
    for name in ORDER:
        if os.path.exists(os.path.join(HERE, f"{name}.json")):
            print(row(name))


if __name__ == "__main__":
    main()
