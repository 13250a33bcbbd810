"""Plot runs side by side: loss (train, eval), tokens/s and MFU against step.

    ndjax plot --workdir=runs/fsdp_tp --workdir=runs/dp [--out=compare.png]
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence

from ndjax.training.sinks import read_records

PANELS = (("loss", "loss"), ("tokens_per_sec", "tokens/s (global)"), ("mfu", "MFU"))


def read_metrics(workdir: str) -> list[dict]:
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        raise SystemExit(f"ndjax plot: error: {path} does not exist; is --workdir a run directory?")
    return [record for record, _ in read_records(path)]  # a torn line: a warning


def series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
    return [p[0] for p in points], [p[1] for p in points]


def plot(workdirs: Sequence[str], out: str) -> str:
    import matplotlib
    matplotlib.use("Agg")  # files only; no display needed
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(PANELS), figsize=(5 * len(PANELS), 4))
    for workdir in workdirs:
        records = read_metrics(workdir)
        name = os.path.basename(os.path.normpath(workdir))
        color = None  # one colour per run across panels
        for ax, (key, _) in zip(axes, PANELS):
            keys = (key, "eval_loss") if key == "loss" else (key,)
            for k in keys:
                steps, values = series(records, k)
                if steps:
                    style = "o--" if k == "eval_loss" else "-"
                    label = f"{name} (eval)" if k == "eval_loss" else name
                    line, = ax.plot(steps, values, style, label=label, color=color)
                    color = line.get_color()
    for ax, (key, title) in zip(axes, PANELS):
        ax.set_title(title)
        ax.set_xlabel("step")
        if ax.lines:
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, "not reported\n(no known peak for this device)"
                    if key == "mfu" else "no data", ha="center", va="center",
                    transform=ax.transAxes)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", action="append", required=True,
                        help="a run directory with metrics.jsonl; repeat to overlay runs")
    parser.add_argument("--out", help="PNG to write (default <first workdir>/plot.png)")
    args = parser.parse_args(argv)
    out = args.out or os.path.join(args.workdir[0], "plot.png")
    print(plot(args.workdir, out))


if __name__ == "__main__":
    main()
