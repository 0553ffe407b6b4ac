"""How close a finished run's ETAs came to the time that really remained.

    fbtrain train --config configs/tiny_shakespeare.yaml > train.log
    python scripts/eta_accuracy.py --log train.log --run runs/tiny_shakespeare

Each plain progress line of the log (``step 725/1500 | ... | eta 9m20s``) is set against the
wall time at which the run wrote that step's record (its TensorBoard event, written right
after the line) and the wall time of its last evaluation's record (the run's end, but for
the closing sample and summary). It prints, per line, the share of the run's time gone (from
the step-0 evaluation), the ETA, the time that remained and their ratio, then how many lines
from ``--after`` of the run's time on came within ``--within`` of it (exit 0), or not (1).
The last step's line is not counted: its record is written after its evaluation, so the
time it shows as remaining is none.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

LINE = re.compile(r"step (\d+)/\d+ \|.* \| eta (?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?$")


def etas(log: Path) -> dict[int, int]:
    """Seconds of the ETA each plain progress line of ``log`` shows, by step."""
    found = {}
    for line in log.read_text(encoding="utf-8").splitlines():
        m = LINE.fullmatch(line.strip())
        if m:
            hours, minutes, seconds = (int(x) if x else 0 for x in m.groups()[1:])
            found[int(m.group(1))] = hours * 3600 + minutes * 60 + seconds
    return found


def wall_times(folder: Path) -> dict[int, float]:
    """The wall time of each step's ``loss`` event in a TensorBoard folder."""
    events = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    events.Reload()
    return {e.step: e.wall_time for e in events.Scalars("loss")}


def compare(log: Path, run: Path) -> list[tuple[int, float, int, float]]:
    """``(step, share of the run's time gone, ETA, seconds that remained)`` per line."""
    written, validated = wall_times(run), wall_times(run / "val")
    start, end = min(validated.values()), max(validated.values())
    return [(step, (written[step] - start) / (end - start), eta, end - written[step])
            for step, eta in sorted(etas(log).items()) if step in written]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--log", type=Path, required=True, help="the run's console output")
    parser.add_argument("--run", type=Path, required=True, help="the run directory")
    parser.add_argument("--after", type=float, default=0.2,
                        help="count lines from this share of the run's time on")
    parser.add_argument("--within", type=float, default=0.25,
                        help="an ETA within this share of the time that remained is good")
    args = parser.parse_args(argv)
    rows = compare(args.log, args.run)
    last = max(step for step, *_ in rows)
    counted = [(step, eta, left) for step, gone, eta, left in rows
               if gone >= args.after and step != last]
    good = sum(abs(eta - left) <= args.within * left for _, eta, left in counted)
    for step, gone, eta, left in rows:
        ratio = f"{eta / left:.2f}" if left > 0 else "-"
        print(f"step {step:6d}  {100 * gone:5.1f}% gone  eta {eta:6d}s  "
              f"remained {left:8.1f}s  ratio {ratio}")
    print(f"from {100 * args.after:.0f}% of the run's time on: {good} of {len(counted)} ETAs "
          f"within {100 * args.within:.0f}% of the time that remained")
    return 0 if good == len(counted) else 1


if __name__ == "__main__":
    sys.exit(main())
