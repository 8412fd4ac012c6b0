"""One line per kernel family (name and grid) from `ncu`'s text report: launches, mean
duration and the speed-of-light, launch and occupancy figures that say why a kernel is slow.

    python -m dev.profile.ncu_table results/h200/profiles/ncu_decode_step_6394d39.txt.gz

The report is ncu's default text output with the SpeedOfLight, LaunchStats and Occupancy
sections (the command that made it is in `dev.profile.profile_launches`). ncu serialises the
kernels, flushes the caches between them and locks the clocks at base, so its durations are
longer than the same kernels' in a replayed graph; compare families with each other."""
import gzip
import re
import sys

_HEADER = re.compile(r"^  (\S+?)\[.*\((\d+), (\d+), (\d+)\)x\((\d+), (\d+), (\d+)\), Context")
_METRIC = re.compile(r"^    (\S.*?)\s{2,}(?:\S+\s+)?([\d,.]+)\s*$")
COLUMNS = (("Duration", "us", "6.2f"), ("DRAM Throughput", "dram%", "5.1f"),
           ("Registers Per Thread", "regs", "4.0f"), ("Waves Per SM", "waves", "5.2f"),
           ("Theoretical Occupancy", "occ%", "5.1f"), ("Achieved Occupancy", "ach%", "5.1f"))


def launches(lines) -> list[dict]:
    """Each profiled launch: its name, grid and block, and each metric's first value."""
    out = []
    for line in lines:
        head = _HEADER.match(line)
        if head:
            name = head.group(1).split("::")[-1]
            out.append({"name": name, "grid": tuple(int(g) for g in head.group(2, 3, 4)),
                        "block": int(head.group(5))})
        elif out and (metric := _METRIC.match(line)):
            out[-1].setdefault(metric.group(1).strip(), float(metric.group(2).replace(",", "")))
    return out


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(__doc__)
        return 2
    path = argv[0]
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
        rows = launches(f)
    families: dict[tuple, list] = {}
    for r in rows:
        families.setdefault((r["name"], r["grid"], r["block"]), []).append(r)
    print(f"{'kernel':32s} {'grid':>14s} {'block':>5s} {'n':>3s} "
          + " ".join(f"{label:>6s}" for _, label, _ in COLUMNS) + f" {'us all':>7s}")
    total = 0.0
    for (name, grid, block), rs in families.items():
        mean = {k: sum(r.get(k, 0.0) for r in rs) / len(rs) for k, _, _ in COLUMNS}
        total += mean["Duration"] * len(rs)
        print(f"{name:32s} {str(grid):>14s} {block:5d} {len(rs):3d} "
              + " ".join(f"{mean[k]:6{fmt[1:]}}" for k, _, fmt in COLUMNS)
              + f" {mean['Duration'] * len(rs):7.1f}")
    print(f"{len(rows)} launches, {total:.1f} us in all (ncu's serialised, base-clock durations)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
