#!/usr/bin/env bash
# The engine under several torch releases, on the CPU (the registry's default wheels run without a GPU): for each
# version a virtual environment outside the repository (/tmp/venv-torch-VERSION, made once and reused), the
# project's requirements with that torch in place of the pinned one, then gpu_check's CPU smoke run (every part,
# compiled, small shapes, a cold inductor cache, at most 12 minutes) and a smoke of the test suite. Each step's
# status and seconds go to the log, one line each, with gpu_check's last line (its summary) and the tests' count.
#
#   bash scripts/torch_matrix.sh 2.11.0 2.14.1                  # log: /tmp/torch-matrix.log
#   LOG=out.log TESTS="tests/test_model.py" bash scripts/torch_matrix.sh 2.13.0
#   TESTS= bash scripts/torch_matrix.sh 2.13.0                     # gpu_check's smoke alone
#   GPU_CHECK=0 bash scripts/torch_matrix.sh 2.11.0                # the tests alone
#
# Exit status: 0 when every step of every version is ok, 1 otherwise, 2 for no version given.
set -uo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 1 ] || { echo "error: name at least one torch version (e.g. 2.11.0 2.14.1)" >&2; exit 2; }
LOG=${LOG:-/tmp/torch-matrix.log}
TESTS=${TESTS-"tests/test_model.py tests/test_generate.py tests/test_speculative.py tests/test_gated_delta.py
               tests/test_tree_attn.py tests/test_graph_pool.py tests/test_tp.py tests/test_gpu_check.py"}
GPU_CHECK_SECONDS=${GPU_CHECK_SECONDS:-720}  # the bar: 12 minutes on 2 cores of their own
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
failed=0

say() { echo "$(date -u +%H:%M:%S) $*" | tee -a "$LOG"; }

# step NAME COMMAND...: runs it with its output in the version's own log, says its status and seconds
step() {
    local name=$1 t0=$SECONDS rc
    shift
    "$@" >>"$VLOG" 2>&1
    rc=$?
    say "torch $V: $name $([ $rc = 0 ] && echo ok || echo "FAILED (exit $rc)") in $((SECONDS - t0)) s" \
        "(load average $(cut -d' ' -f1-3 /proc/loadavg): other jobs share the cores)"
    [ $rc = 0 ] || failed=1
    return $rc
}

# The requirements less torch's pin and its constraint: torch comes from the command line.
REQ=$(mktemp)
grep -hv -e '^-r' -e '^-c' -e '^torch' requirements.txt requirements-dev.txt | sed 's/#.*//' | grep . >"$REQ"

for V in "$@"; do
    VENV=/tmp/venv-torch-$V VLOG=/tmp/torch-matrix-$V.log
    : >"$VLOG"
    say "torch $V: venv $VENV, output in $VLOG"
    [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
    step install "$VENV/bin/pip" install -q "torch==$V" -r "$REQ" || continue
    step dflash "$VENV/bin/pip" install -q --no-deps dflash==0.1.0 || continue
    say "torch $V: $("$VENV/bin/python" -c 'import torch, transformers, sys
print("python", sys.version.split()[0], "torch", torch.__version__, "transformers", transformers.__version__)')"
    export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-matrix-$V
    rm -rf "$TORCHINDUCTOR_CACHE_DIR"  # gpu_check's smoke compiles from a cold cache, as on a fresh machine
    if [ "${GPU_CHECK:-1}" != 0 ]; then
        step "gpu_check --device cpu --small" timeout $GPU_CHECK_SECONDS "$VENV/bin/python" scripts/gpu_check.py \
            --device cpu --small --json "/tmp/torch-matrix-$V.json"
        say "torch $V: gpu_check's last line: $(tail -1 "$VLOG")"
    fi
    [ -n "$TESTS" ] || continue
    # shellcheck disable=SC2086  # TESTS is a list of paths
    step "tests ($(echo $TESTS | wc -w) files)" "$VENV/bin/python" -m pytest -q -n 0 -rfE $TESTS
    grep -E '^(FAILED|ERROR) |[0-9]+ (passed|failed)' "$VLOG" | sed "s/^/$(date -u +%H:%M:%S) torch $V: /" |
        tee -a "$LOG"
done
rm -f "$REQ"
exit $failed
