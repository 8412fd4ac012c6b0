"""One script per figure. Each `run(size)` writes results/<device>/<name>.csv and
<name>.summary.json; each `plot()` reads only those files and writes figures/<name>.png."""
