#!/usr/bin/env bash
# How do I know hvdkit works with each supported TensorFlow? Run this: for each
# version, a venv of its own (outside the repository), `pip install tensorflow-cpu==V`,
# then hvdkit as a user installs it, Horovod built by `python -m hvdkit install-horovod`,
# `hvdkit doctor`, and the quick tier (tests/unit) plus the 2-rank training and Keras
# workflow tests. Prints a Markdown table (paste it into README.md with its date) and
# writes it as JSON. Run it before each release-like change; one build at a time.
#
#   scripts/matrix.sh                              # every version in TF_VERSIONS
#   HVDKIT_MATRIX_TF="2.19.0 2.21.0" scripts/matrix.sh
#   HVDKIT_MATRIX_CANARY=1 scripts/matrix.sh       # also the canary rows: keras-nightly on the
#                                                  # newest TF, and tf-nightly-cpu with its Keras
#   HVDKIT_MATRIX_CANARY=keras-nightly scripts/matrix.sh  # one canary row alone (or tf-nightly)
#   HVDKIT_MATRIX_TABLE=1 scripts/matrix.sh        # only print the table of recorded rows
#
# It tests the committed HEAD (exported to $ROOT/src-<commit>), not the working tree, so
# uncommitted edits do not count; each row records its commit.
# Rows are kept in $ROOT/results/<row>.json (default ROOT ~/.cache/hvdkit/matrix), so
# versions run on different days make one table, each row with its date. The canary
# rows never fail the run: they tell what a newer Keras or TensorFlow breaks before
# users meet it.
set -uo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TF_VERSIONS=(${HVDKIT_MATRIX_TF:-2.18.0 2.19.0 2.20.0 2.21.0})
ROOT="${HVDKIT_MATRIX_DIR:-${XDG_CACHE_HOME:-${HOME:-/root}/.cache}/hvdkit/matrix}"
PY_BIN="${HVDKIT_PYTHON:-python3.11}"
TESTS=(tests/unit tests/test_training_mp.py tests/test_keras_workflows_mp.py)
mkdir -p "$ROOT/results"
COMMIT="$(git -C "$REPO" rev-parse --short HEAD)"
SRC="$ROOT/src-$COMMIT"
if [[ -z "${HVDKIT_MATRIX_TABLE:-}" && ! -d "$SRC" ]]; then
    mkdir -p "$SRC.tmp" && git -C "$REPO" archive HEAD | tar -x -C "$SRC.tmp" && mv "$SRC.tmp" "$SRC"
fi
if [[ $(id -u) -eq 0 ]]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
export TF_CPP_MIN_LOG_LEVEL=2

say() { printf '[matrix] %s\n' "$*"; }

# A Horovod build takes both cores for minutes: start one only on a quiet machine. Waits
# while the 1-minute load average is >= HVDKIT_MATRIX_MAX_LOAD (default 3), at most
# HVDKIT_MATRIX_WAIT seconds (default 1200); then the row is skipped, saying so.
wait_for_quiet() {
    local max="${HVDKIT_MATRIX_MAX_LOAD:-3}" limit="${HVDKIT_MATRIX_WAIT:-1200}" waited=0
    while awk -v m="$max" '{exit !($1 >= m)}' /proc/loadavg; do
        if ((waited >= limit)); then say "still busy after ${waited} s: no build"; return 1; fi
        ((waited == 0)) && say "load $(cut -d' ' -f1 /proc/loadavg) >= $max: waiting to build"
        sleep 30; waited=$((waited + 30))
    done
}

# One row: run_row NAME TF_REQUIREMENT [KERAS_PACKAGE]. Writes $ROOT/results/NAME.json.
run_row() {
    local name="$1" tf="$2" keras_pkg="${3:-}" venv="$ROOT/$1" log="$ROOT/$1.log"
    local any=(); if [[ "$name" == *nightly* ]]; then any=(--any-tensorflow); fi
    local py="$venv/bin/python" pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
    local note="" installed=false tf_kept=false build="" build_s=0 doctor_rc=-1 summary="" tests_rc=-1 t0
    local companions='^(tensorflow|keras|tensorboard|protobuf|h5py|numpy)'
    : >"$log"
    say "$name: venv $venv (log $log)"
    if [[ ! -x "$py" ]]; then "$PY_BIN" -m venv "$venv" >>"$log" 2>&1; fi
    if ! "${pip[@]}" "$tf" >>"$log" 2>&1; then
        note="$tf did not install"
    else
        "$py" -m pip freeze | grep -iE "$companions" >"$ROOT/$name.before"
        if "${pip[@]}" "$SRC[test]" >>"$log" 2>&1; then
            installed=true
            "$py" -m pip freeze | grep -iE "$companions" >"$ROOT/$name.after"
            # the user's TensorFlow, Keras and their companions must be untouched; added
            # ones are fine ([test] brings tensorboard where TF 2.21 has none)
            diff "$ROOT/$name.before" "$ROOT/$name.after" >>"$log"
            if [[ -z "$(comm -23 <(sort "$ROOT/$name.before") <(sort "$ROOT/$name.after"))" ]]; then
                tf_kept=true
            fi
        else
            note="pip install hvdkit[test] failed"
        fi
    fi
    if $installed && [[ -n "$keras_pkg" ]]; then
        # keras-nightly ships the same `keras` package: swap it in after hvdkit (whose
        # keras requirement brought `keras` next to tf-nightly's keras-nightly)
        if ! "${pip[@]}" "$keras_pkg" >>"$log" 2>&1; then
            note="$keras_pkg is not in the registry (pip: no matching distribution)"; installed=false
        else
            "$py" -m pip uninstall -q -y keras >>"$log" 2>&1
            "${pip[@]}" --force-reinstall --no-deps "$keras_pkg" >>"$log" 2>&1
        fi
    fi
    if $installed; then
        local cached
        cached="$("$py" -c 'from hvdkit.tools import install_horovod as i
print(i.cached_wheel(i.cache_dir(next(iter(i.tensorflow_distributions().values())))) or "")')"
        if [[ -z "$cached" ]] && ! wait_for_quiet; then
            note="not built: load >= ${HVDKIT_MATRIX_MAX_LOAD:-3} for ${HVDKIT_MATRIX_WAIT:-1200} s"
            installed=false
        fi
    fi
    if $installed; then
        t0=$SECONDS
        if "$py" -m hvdkit install-horovod "${any[@]}" >>"$log" 2>&1; then
            build_s=$((SECONDS - t0))
            build="built"; grep -q "using the cached wheel\|is installed, built for" "$log" && build="cached"
        else
            build="failed"; note="Horovod build failed (see $log)"
        fi
        if [[ "$build" != failed ]]; then
            "$py" -m hvdkit doctor >>"$log" 2>&1; doctor_rc=$?
            (cd "$SRC" && "$py" -m pytest "${TESTS[@]}" -p no:cacheprovider -q -n 2 \
                --dist loadfile >>"$log" 2>&1); tests_rc=$?
            summary="$(grep -E '[0-9]+ (passed|failed|error).* in [0-9.]+s' "$log" | tail -1)"
        fi
    fi
    "$PY_BIN" - "$ROOT/results/$name.json" "$py" <<PYEOF
import json, re, subprocess, sys, time
out, py = sys.argv[1], sys.argv[2]
def version(dist):
    q = f"import importlib.metadata as m; print(m.version('{dist}'))"
    r = subprocess.run([py, "-c", q], capture_output=True, text=True)
    return r.stdout.strip() or None
summary = """$summary"""
counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?)", summary)}
row = {
    "row": "$name", "commit": "$COMMIT", "date": time.strftime("%Y-%m-%d"), "tensorflow": version("tensorflow-cpu") or version("tf-nightly-cpu"),
    "keras": version("keras") or version("keras-nightly"), "python": "${PY_BIN#python}",
    "tf_kept": "$tf_kept" == "true", "horovod_build": "$build", "build_s": $build_s,
    "doctor_ok": $doctor_rc == 0, "passed": counts.get("passed", 0),
    "failed": counts.get("failed", 0) + counts.get("error", 0) + counts.get("errors", 0),
    "skipped": counts.get("skipped", 0), "tests_ok": $tests_rc == 0, "note": """$note""",
    "failures": [ln.split()[1] for ln in open("$log", errors="replace") if ln.startswith(("FAILED ", "ERROR "))],
}
json.dump(row, open(out, "w"), indent=1)
PYEOF
}

if [[ -z "${HVDKIT_MATRIX_TABLE:-}" ]]; then
    canary="${HVDKIT_MATRIX_CANARY:-}"
    if [[ "$canary" != *nightly ]]; then
        for tf in "${TF_VERSIONS[@]}"; do
            run_row "tf$tf" "tensorflow-cpu==$tf"
        done
    fi
    if [[ -n "$canary" && "$canary" != tf-nightly ]]; then
        run_row "tf${TF_VERSIONS[-1]}-keras-nightly" "tensorflow-cpu==${TF_VERSIONS[-1]}" keras-nightly
    fi
    if [[ -n "$canary" && "$canary" != keras-nightly ]]; then
        run_row "tf-nightly" "tf-nightly-cpu" keras-nightly  # its own Keras, kept over [test]'s
    fi
fi

"$PY_BIN" - "$ROOT" <<'PYEOF'
import json, pathlib, sys
root = pathlib.Path(sys.argv[1])
rows = [json.loads(p.read_text()) for p in sorted((root / "results").glob("*.json"))]
json.dump(rows, open(root / "matrix.json", "w"), indent=1)
print("| TensorFlow | Keras | Python | TF kept by pip install | Horovod build | doctor | tests passed | date, commit | note |")
print("|---|---|---|---|---|---|---|---|---|")
for r in rows:
    build = r["horovod_build"] + (f" {r['build_s']} s" if r["horovod_build"] == "built" else "")
    tests = f"{r['passed']}/{r['passed'] + r['failed']}" + (f" ({r['skipped']} skipped)" if r["skipped"] else "")
    print(f"| {r['tensorflow']} | {r['keras']} | {r['python']} | {'yes' if r['tf_kept'] else 'NO'} "
          f"| {build} | {'ok' if r['doctor_ok'] else 'FAIL'} | {tests} | {r['date']}, {r.get('commit', '?')} | {r['note']} |")
print(f"\n[matrix] JSON: {root / 'matrix.json'}", file=sys.stderr)
bad = [r["row"] for r in rows if "nightly" not in r["row"] and not (r["tests_ok"] and r["doctor_ok"] and r["tf_kept"])]
sys.exit(1 if bad else 0)
PYEOF
