"""Run reporting: a live line per step, JSONL and TensorBoard logs, and a final plot."""

from __future__ import annotations

import json
import sys
from pathlib import Path

_COLUMNS = (("step", "{:>4}"), ("reward", "{:6.3f}"), ("k3_mean", "{:9.2e}"), ("k3_max", "{:9.2e}"),
            ("gen_s", "{:6.1f}"), ("train_s", "{:6.1f}"), ("sync_s", "{:6.1f}"), ("wait_s", "{:6.1f}"))


class Reporter:
    def __init__(self, run_dir: Path, *, resume_step: int = 0):
        """A new run starts an empty log; a resumed one keeps the records up to `resume_step`."""
        self.run_dir = run_dir
        self.jsonl = run_dir / "metrics.jsonl"
        kept = [r for r in self.read(run_dir) if r["step"] <= resume_step]
        self.jsonl.write_text("".join(json.dumps(r) + "\n" for r in kept))
        self.tb = None
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(run_dir / "tensorboard"))
        except ImportError:  # tensorboard is optional
            pass
        print("  ".join(name.rjust(len(fmt.format(0))) for name, fmt in _COLUMNS), flush=True)

    def step(self, record: dict) -> None:
        with self.jsonl.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.tb is not None:
            for k, v in record.items():
                if isinstance(v, (int, float)) and k != "step":
                    self.tb.add_scalar(k, v, record["step"])
            self.tb.flush()
        row = []
        for name, fmt in _COLUMNS:
            v = record.get(name)
            row.append(fmt.format(v) if v is not None else "-".rjust(len(fmt.format(0))))
        print("  ".join(row), flush=True)

    @staticmethod
    def read(run_dir: Path) -> list[dict]:
        path = run_dir / "metrics.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def close(self) -> Path | None:
        if self.tb is not None:
            self.tb.close()
        return plot(self.read(self.run_dir), self.run_dir / "rl.png")


def plot(records: list[dict], out: Path) -> Path | None:
    """Reward (and the tool-use rate of tool environments) and mismatch KL over steps, as a PNG."""
    if not records:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.5))
    ax1.plot(steps, [r["reward"] for r in records], marker="o", label="mean reward")
    if all("tool_use_rate" in r for r in records):  # tool environments: the fraction of rollouts that used a tool
        ax1.plot(steps, [r["tool_use_rate"] for r in records], marker="s", label="tool-use rate")
        ax1.legend()
    ax1.set(xlabel="step", ylabel="mean reward", title="reward")
    ax2.plot(steps, [r["k3_mean"] for r in records], marker="o", label="mean k3")
    ax2.plot(steps, [r["k3_max"] for r in records], marker="x", label="max k3")
    ax2.set(xlabel="step", ylabel="k3 KL (trainer vs inference)", title="mismatch", yscale="log")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def log(msg: str) -> None:
    print(f"[moerl] {msg}", file=sys.stderr, flush=True)
