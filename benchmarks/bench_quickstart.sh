#!/usr/bin/env bash
# Wall-clock time of the README's quickstart command, from a clean runs/ directory (imports,
# process launch, corpus tokenizing, training, validation, checkpoints, the sample: everything a
# new user waits for), with the machine's load before and after and the run's last figures.
#   bash benchmarks/bench_quickstart.sh
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
cp -r configs "$work/"
cd "$work"
echo "# bench_quickstart $(date -u +%FT%TZ)  $(nproc) CPUs  load before: $(cut -d' ' -f1-3 /proc/loadavg)"
start=$(date +%s.%N)
lightning-disttrain fit --config configs/quickstart.yaml > quickstart.log 2>&1
end=$(date +%s.%N)
echo "# load after: $(cut -d' ' -f1-3 /proc/loadavg)"
printf 'wall %.1f s\n' "$(echo "$end - $start" | bc)"
grep -o '[0-9]*/[0-9]* [0-9:]* • [0-9:]* [0-9.]*it/s' quickstart.log | tail -1 | sed 's/^/progress bar at the end: /'
grep -o 'val/loss: [0-9.]*' quickstart.log | tail -1
ls runs/quickstart/checkpoints | tr '\n' ' ' | sed 's/^/checkpoints: /'; echo
rm -rf "$work"
