#!/usr/bin/env bash
# Put Debian's `prometheus` and `promtool` binaries into DEST (make setup: .venv/bin) for the
# dashboard tests (tests/helm/test_dashboards*.py), without root: the package is downloaded with
# apt into a private state folder and unpacked, nothing is installed system-wide. Both are static
# Go programs that need only libc. Where they are already on PATH, or apt or the Debian mirror is
# unreachable, it does nothing and says so; the tests then skip with that reason.
set -uo pipefail
dest=${1:?usage: fetch-prometheus.sh DEST}
if [ -x "$dest/prometheus" ] && [ -x "$dest/promtool" ]; then exit 0; fi
if command -v prometheus >/dev/null && command -v promtool >/dev/null; then exit 0; fi
if ! command -v apt-get >/dev/null || ! command -v dpkg-deb >/dev/null; then
    echo "fetch-prometheus: no apt-get/dpkg-deb here; the live dashboard tests will skip" >&2
    exit 0
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/lists/partial" "$work/cache/archives/partial"
opts=(-qq -o "Dir::State::Lists=$work/lists" -o "Dir::Cache=$work/cache" -o Debug::NoLocking=1)
if apt-get "${opts[@]}" update >"$work/log" 2>&1 \
    && (cd "$work" && apt-get "${opts[@]}" download prometheus >>"$work/log" 2>&1) \
    && dpkg-deb -x "$work"/prometheus_*.deb "$work/root" \
    && "$work/root/usr/bin/prometheus" --version >/dev/null 2>&1; then
    install -m 0755 "$work/root/usr/bin/prometheus" "$work/root/usr/bin/promtool" "$dest/"
    echo "fetch-prometheus: $("$dest/prometheus" --version 2>&1 | head -1) -> $dest" >&2
else
    echo "fetch-prometheus: could not fetch Debian's prometheus; the live dashboard tests will skip" >&2
    tail -5 "$work/log" >&2
fi
exit 0
