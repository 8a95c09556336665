"""Time, clock and energy of each timed row of the device records (the H200's, and the H100's
where no H200 was lent: the table names the card, and by its UUID's end where the record
keeps one) against the floor run as one step, read from the committed records, loose and
archived (no GPU).

At the H200's 700 W cap a step's speed is its energy: a step that does more work per
microsecond runs at a lower SM clock. Each floor-relative suite (``layer_train``,
``layer_forward``, ``lm_head_train``) times its floor's GEMMs and attention back to back
(``floor_as_one_step``) beside the peers, with the median SM clock and board power sampled
over the timed rounds. So for each row against that floor, in the same call:

    time    ms / floor ms
    cycles  (ms x MHz) / (floor ms x floor MHz)   the time at the floor's clock: what the
                                                  row would read if it drew no more power
    energy  (ms x W) / (floor ms x floor W)       joules a step

and, where the record has it, the same time and cycles against the issues' floor, the floor's
parts each timed alone (``parts`` = the floor as one step over its parts, ``ratio_vs_floor``).

``cycles`` assumes a step's time scales as 1 / clock, as its compute-bound GEMMs do; its
memory-bound passes and latencies scale less, so for a row under the floor's clock it is a
lower bound (and ``time`` an upper one). The clock is sampled in 15 MHz steps: read it to
~1-2 %. A row with cycles near 1 and energy above 1 loses its time to the power cap, not to
its kernels' cycles.

    python benchmarks/records_energy.py [first_run] [--rows coda,torch_compile,...]
"""

from __future__ import annotations

import argparse
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import records  # noqa: E402

SUITES = ("layer_train", "layer_forward", "lm_head_train")
FLOOR = "floor_as_one_step"
# the row each suite times coda's user call by (the forward suite's ``coda`` row is the
# functional call, ``coda_decoder_layer`` the module's)
CODA_ROW = {"layer_forward": "coda_decoder_layer"}


def run_number(path: str) -> int:
    return int(re.search(r"run(\d+)", os.path.basename(path)).group(1))


def ratios(row: dict, floor: dict) -> dict:
    """``row`` against ``floor`` (each a timed record row with ms, sm_mhz and power_w)."""
    return {
        "time": row["ms"] / floor["ms"],
        "mhz": (row["sm_mhz"], floor["sm_mhz"]),
        "cycles": row["ms"] * row["sm_mhz"] / (floor["ms"] * floor["sm_mhz"]),
        "energy": row["ms"] * row["power_w"] / (floor["ms"] * floor["power_w"]),
        "parts": floor.get("ratio_vs_floor", float("nan")),
    }


def table(record: dict, wanted: tuple[str, ...]):
    """Yields (suite, d, row name, ratios) for every wanted row beside its floor; ``coda``
    asks for the suite's ``CODA_ROW``."""
    for suite in SUITES:
        timed = {}
        for row in record.get("benchmarks", {}).get(suite, []):
            uniform = isinstance(row, dict) and row.get("targets", "uniform") == "uniform"
            if uniform and "power_w" in row:
                timed[(row["d"], row["name"].rsplit("/", 1)[-1])] = row
        for (d, name), row in sorted(timed.items()):
            floor = timed.get((d, FLOOR))
            coda = "coda" in wanted and name == CODA_ROW.get(suite, "coda")
            peer = name in wanted and name != "coda"
            if floor is not None and (coda or peer):
                yield suite, d, name, ratios(row, floor)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("first_run", nargs="?", type=int, default=160)
    ap.add_argument("--rows", default="coda,torch_compile,quack_chunked_lce,liger")
    args = ap.parse_args(argv)
    wanted = tuple(args.rows.split(","))
    kept = sorted(
        ((run_number(name), name, record) for name, record in records.every() if "_run" in name),
        key=lambda r: r[:2],
    )
    print(
        "| run | card | commit | suite | d | row | time | MHz (row / floor) | cycles | energy "
        "| time / parts | cycles / parts |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for run, name, record in kept:
        if run < args.first_run:
            continue
        card = name.split("_")[1]  # (the file name's: h200, h100, ...)
        uuid = record.get("card", {}).get("uuid")  # (recorded since session 89)
        card += f" {uuid[-8:]}" if uuid else ""  # which card: runs on one model differ by it
        for suite, d, row, r in table(record, wanted):
            print(
                f"| {run} | {card} | {record.get('commit', '?')} | {suite} | {d} | {row} "
                f"| {r['time']:.3f} | {r['mhz'][0]:.0f} / {r['mhz'][1]:.0f} "
                f"| {r['cycles']:.3f} | {r['energy']:.3f} "
                f"| {r['time'] * r['parts']:.3f} | {r['cycles'] * r['parts']:.3f} |"
            )


if __name__ == "__main__":
    main()
