#!/usr/bin/env bash
# One device call's worth of GPU measurements, as ONE command, from the repo root; everything lands in "$OUT".
#
#   bash benchmarks/gpu_session.sh                  # on the GPU machine (carry .whl; OUT is set by the device tool)
#   OUT=/tmp/gpu_dry PYTHON=.venv/bin/python bash benchmarks/gpu_session.sh --dry-run   # same steps, CPU, tiny recipe
#
# Steps, in order, each under its own `timeout` and logged into $OUT/session.log; a failing or timed-out
# step is recorded and the script goes on:
#   install  the carried wheels (.whl/*.whl) into /tmp/site; PYTHONPATH=/tmp/site:$PWD
#   doctor   python -m jaxlm.doctor --expect=gpu
#   mfu      benchmarks/mfu.py --recipe 1b (micro-batches resolved by the planner)   -> $OUT/mfu_1b.json
#   profile  benchmarks/profile_step.py --recipe 1b: one profiled step, its kernels summed by category
#            (GEMMs, attention, fusions, copies, collectives) and the largest       -> $OUT/profile.json
#   attention  benchmarks/attention.py at 1b's shapes (8 x 2048, documents of mean length 512): each kernel
#            checked against the float32 reference, then timed: cuDNN with the document mask (jaxlm's path),
#            cuDNN's packed layout, Pallas with segment ids, XLA, cuDNN causal-only  -> $OUT/attention.json
#   ring     benchmarks/ring_blocks.py: context parallelism's ring blocks by cuDNN (model.attention=cudnn) against
#            their XLA emulation, which the CPU tests check the ring on (its lines go into session.log)
#   sweep    mfu.py per point over model.attention x model.loss_chunk_len [x run.xla_flags], one process per
#            point, in priority order, while the time budget allows                  -> $OUT/mfu_sweep.json
#            (attention=cudnn, loss_chunk_len=0 is the `mfu` step itself: 'auto' picks cudnn on a GPU; the
#            points with XLA flags compare against it, one candidate flag each)
#   fp8      mfu.py with model.matmul=fp8 (float8 projections, issue 24), as a sweep point -> $OUT/mfu_sweep.json
#   train    `make train`'s job (python -m jaxlm.train --config=configs/tiny.py) on the GPU, its energy meter
#            reading NVML, then the same run with model.dtype=float16 (dynamic loss scaling, issue 24);
#            both runs' summary.json; the first run's trace of 10 steps summarized (busy against span)
#                                                                                      -> $OUT/train.json
#   ckpt     benchmarks/checkpoint.py --recipes 125m --steps 40 --snapshot off auto host (issues 4, 21)
#                                                                                      -> $OUT/checkpoint.json
#   hlo      benchmarks/hlo_audit.py --recipe 1b, only if time is left                -> $OUT/hlo_audit.json
#   notebook notebooks/01_quickstart.ipynb in a real Jupyter kernel on this machine's Python, with the
#            wheels in .whl/nb (nbclient, ipykernel, matplotlib, ...) installed to /tmp/nbsite (issue 8:
#            the notebooks run on a GPU unchanged); its text outputs go into session.log
# At most 8 files come back (the device tool returns 8 at most, 16 MiB each, 2 folders deep).
#
# The whole script keeps to GPU_SESSION_BUDGET_S seconds (default 540, inside a 600 s call): each step's
# limit is min(its cap, what is left of the budget less what later steps are reserved).
#
# Knobs (environment):
#   PYTHON                  interpreter (default python3)
#   GPU_SESSION_DRY=1       same as --dry-run
#   GPU_SESSION_BUDGET_S    total seconds (default 540; dry 300)
#   GPU_SESSION_STEPS       which steps to run, space-separated (default "doctor mfu profile attention ring sweep fp8 train
#                           ckpt hlo notebook")
#                           e.g. a second call: GPU_SESSION_STEPS="sweep hlo" bash benchmarks/gpu_session.sh
#   GPU_SESSION_SWEEP       sweep points "attention:loss_chunk_len[:xla_flag,xla_flag] ..." in priority order;
#                           attention cudnn-mask = cuDNN with the document mask instead of its packed layout,
#                           cudnn-segN = the packed layout compiled for N documents per row (the default is 16)
#                           (default: cudnn:0 with XLA's second GEMM fusion and cuDNN's GEMM fusions, the same
#                           with Triton forced, cudnn-seg8:0 cudnn-mask:0 xla:0 pallas:0, cudnn:0 with cuBLAS for
#                           every GEMM, see below; dry "cudnn-mask:0 xla:0
#                           pallas:0 cudnn:64 xla:64 xla:0:--xla_gpu_enable_triton_gemm=false")
#   MFU_DOC_LEN             the mfu, sweep and fp8 steps' batches: documents of this mean length packed in each
#                           row (default 512; 0 = one document per row, as in the H200 call)
#   MFU_STEPS/MFU_WARMUP    timed/warm-up steps of the mfu step (default 5/2; dry 2/1)
#   SWEEP_STEPS/SWEEP_WARMUP  the same per sweep point (default 2/1; dry 1/1)
#   JAX_COMPILATION_CACHE_DIR  persistent XLA cache (default /tmp/jaxlm_xla_cache): a program compiled
#                           again in this call (or a later call on the same warm machine) is loaded, and
#                           its compile_s is then the load time

set -u
set -o pipefail

DRY=${GPU_SESSION_DRY:-0}
for arg in "$@"; do
    case "$arg" in
        --dry-run) DRY=1 ;;
        -h|--help) sed -n '2,/^$/p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "gpu_session.sh: unknown argument $arg (use --dry-run)" >&2; exit 2 ;;
    esac
done

PYTHON=${PYTHON:-python3}
if [ "$DRY" = 1 ]; then
    OUT=${OUT:-/tmp/gpu_dry}
    BUDGET=${GPU_SESSION_BUDGET_S:-300}
    BIG=tiny; CKPT_RECIPE=tiny; EXPECT=cpu
    SWEEP=${GPU_SESSION_SWEEP:-"cudnn-mask:0 xla:0 pallas:0 cudnn:64 xla:64 xla:0:--xla_gpu_enable_triton_gemm=false"}
    MFU_STEPS=${MFU_STEPS:-2}; MFU_WARMUP=${MFU_WARMUP:-1}
    SWEEP_STEPS=${SWEEP_STEPS:-1}; SWEEP_WARMUP=${SWEEP_WARMUP:-1}
    CKPT_ARGS=(--steps 4 --every 2)
    MFU_DOC_LEN=${MFU_DOC_LEN:-20}; TRAIN_ARGS=(--config.run.steps=20 --config.run.eval_every=10); TRAIN_PROFILE=10:12
    #        cap min reserve (seconds)
    DOCTOR=(60 10 0); MFU=(120 20 0); ATTN=(120 20 0); POINT=(90 20 60); CKPT=(90 20 0); HLO=(120 30 0); NB=(240 60 0)
    TRAIN=(150 30 0); FP8=(90 20 30); PROFILE=(90 20 0)
    ATTN_ARGS=(--recipe tiny --seq 64 --batch 2 --doc_len 20 --pad 5)
    RING=(60 10 0); RING_ARGS=(--blocks xla --seq 64 --doc_len 20)  # no cuDNN on a CPU: the emulation against itself
else
    if [ -z "${OUT:-}" ]; then
        OUT=/tmp/gpu_session_out
        echo "gpu_session.sh: OUT is not set; writing to $OUT" >&2
    fi
    BUDGET=${GPU_SESSION_BUDGET_S:-540}
    BIG=1b; CKPT_RECIPE=125m; EXPECT=gpu
    # XLA GPU flags MaxText and others set (each alone, against XLA's defaults): cuBLAS instead of Triton
    # for GEMMs, no CUDA graphs, the latency-hiding scheduler (for one GPU: overlap of copies, if any)
    # measured on an H100 (2026-11-26): the mask (cudnn-mask), XLA's flags, XLA's second GEMM fusion
    # (--xla_gpu_experimental_gemm_fusion_v2=true: no change, the autotuner keeps cuBLAS, which fuses
    # nothing; with --xla_gpu_cublas_fallback=false the autotuner's correctness check failed). Next: the
    # second GEMM fusion with cuDNN's GEMM fusions allowed (cuDNN takes elementwise prologues and
    # epilogues), then with Triton forced and the autotuner's check off (level 3: compare the row's loss
    # with the default's), then the packed layout's bound of 8
    V2=--xla_gpu_experimental_gemm_fusion_v2=true
    SWEEP=${GPU_SESSION_SWEEP:-"cudnn:0:$V2,--xla_gpu_cudnn_gemm_fusion_level=3 cudnn:0:$V2,--xla_gpu_cublas_fallback=false,--xla_gpu_autotune_level=3 cudnn-seg8:0 cudnn-mask:0 xla:0 pallas:0 cudnn:0:--xla_gpu_enable_triton_gemm=false"}
    MFU_STEPS=${MFU_STEPS:-5}; MFU_WARMUP=${MFU_WARMUP:-2}
    SWEEP_STEPS=${SWEEP_STEPS:-2}; SWEEP_WARMUP=${SWEEP_WARMUP:-1}
    # the host copy in `save`; (where it fits) a copy on the device; that copy sent on to pinned host memory at
    # once. 40 steps: 8 saves, 5 of them with retention (2026-11-27: 20 steps hid the commits' backlog)
    CKPT_ARGS=(--steps 40 --snapshot off auto host)
    MFU_DOC_LEN=${MFU_DOC_LEN:-512}; TRAIN_ARGS=(); TRAIN_PROFILE=150:159
    DOCTOR=(90 20 0); MFU=(240 60 0); ATTN=(150 40 0); POINT=(150 90 130); CKPT=(240 45 0); HLO=(300 60 0); NB=(240 60 0)
    TRAIN=(120 30 0); FP8=(150 90 80); PROFILE=(120 40 0)
    ATTN_ARGS=(--recipe 1b --max_segments 16)  # the packed layout at the model's default bound
    RING=(90 20 0); RING_ARGS=()
fi
STEPS=" ${GPU_SESSION_STEPS:-doctor mfu profile attention ring sweep fp8 train ckpt hlo notebook} "

mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
LOG=$OUT/session.log
SCRATCH=$(mktemp -d "${TMPDIR:-/tmp}/gpu_session.XXXXXX")
export PYTHONUNBUFFERED=1
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/jaxlm_xla_cache}
mkdir -p "$JAX_COMPILATION_CACHE_DIR"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
SECONDS=0
SUMMARY=()

log() { printf '%s\n' "$*" | tee -a "$LOG"; }
left() { echo $((BUDGET - SECONDS)); }
wanted() { [[ "$STEPS" == *" $1 "* ]]; }

# step NAME CAP MIN RESERVE -- command...: run it under timeout, log it, record rc and seconds.
step() {
    local name=$1 cap=$2 min=$3 reserve=$4; shift 5
    local t=$(( $(left) - reserve ))
    (( t > cap )) && t=$cap
    if (( t < min )); then
        log "### [$name] SKIPPED at ${SECONDS}s: $(left)s of the budget left, $reserve reserved, needs ${min}s"
        SUMMARY+=("$name|skipped|0|$cap")
        return 0
    fi
    log "### [$name] start at ${SECONDS}s, limit ${t}s: $*"
    local t0=$SECONDS rc
    timeout -k 15 "$t" "$@" 2>&1 | tee "$SCRATCH/step.log" | tee -a "$LOG"
    rc=${PIPESTATUS[0]}
    local status=ok
    (( rc == 124 || rc == 137 )) && status="TIMED OUT (${t}s)"
    (( rc != 0 && rc != 124 && rc != 137 )) && status="failed rc=$rc"
    log "### [$name] $status after $((SECONDS - t0))s"
    SUMMARY+=("$name|$status|$((SECONDS - t0))|$t")
    return "$rc"
}

: > "$LOG"
log "# gpu_session.sh $(date -u +%Y-%m-%dT%H:%M:%SZ) | dry=$DRY | budget ${BUDGET}s | python $($PYTHON -V 2>&1) | $(uname -m)"
log "# repo $(git rev-parse --short HEAD 2>/dev/null || echo '(no git)') | OUT=$OUT | cache $JAX_COMPILATION_CACHE_DIR | steps:$STEPS"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee -a "$LOG"

# 1. install ------------------------------------------------------------------------------------------------
t0=$SECONDS
if [ "$DRY" = 1 ] && $PYTHON -c 'import grain, ml_collections, array_record' 2>/dev/null; then
    log "### [install] skipped (dry run, grain/ml_collections/array_record importable)"
    SUMMARY+=("install|skipped|0|-")
elif ls .whl/*.whl >/dev/null 2>&1; then
    log "### [install] $(ls .whl | tr '\n' ' ')"
    timeout -k 10 120 $PYTHON -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl >"$SCRATCH/pip.log" 2>&1
    rc=$?
    grep -v "Running pip as the 'root' user" "$SCRATCH/pip.log" | tee -a "$LOG"
    if (( rc == 0 )); then
        export PYTHONPATH=/tmp/site:$PYTHONPATH
        SUMMARY+=("install|ok|$((SECONDS - t0))|120")
    else
        SUMMARY+=("install|failed rc=$rc|$((SECONDS - t0))|120")
    fi
    log "### [install] rc=$rc after $((SECONDS - t0))s; PYTHONPATH=$PYTHONPATH"
else
    log "### [install] no .whl/*.whl here (name .whl in the call's carry); going on with what is installed"
    SUMMARY+=("install|no wheels|0|-")
fi
$PYTHON -c 'import grain, ml_collections, array_record; print("# imports ok: grain", grain.__version__ if hasattr(grain, "__version__") else "")' 2>&1 | tail -1 | tee -a "$LOG"

# 2. doctor -------------------------------------------------------------------------------------------------
wanted doctor && step doctor "${DOCTOR[@]}" -- $PYTHON -m jaxlm.doctor --expect=$EXPECT

# 3. MFU of the big recipe (micro-batches resolved automatically) ------------------------------------------
wanted mfu && step mfu "${MFU[@]}" -- $PYTHON benchmarks/mfu.py --recipe $BIG --steps "$MFU_STEPS" \
    --warmup "$MFU_WARMUP" --doc_len "$MFU_DOC_LEN" --json "$OUT/mfu_1b.json"

# 3a. one profiled step of the same program (the compile is in the cache by now): kernels by category ------
wanted profile && step profile "${PROFILE[@]}" -- $PYTHON benchmarks/profile_step.py --recipe $BIG --steps 2 \
    --doc_len "$MFU_DOC_LEN" --json "$OUT/profile.json"

# 3b. attention kernels at the big recipe's shapes, with packed documents --------------------------------
wanted attention && step attention "${ATTN[@]}" -- $PYTHON benchmarks/attention.py "${ATTN_ARGS[@]}" \
    --json "$OUT/attention.json"

# 3c. the context-parallel ring's cuDNN blocks against their emulation (into session.log: 8 files come back at most)
wanted ring && step ring "${RING[@]}" -- $PYTHON benchmarks/ring_blocks.py "${RING_ARGS[@]}"

# 4. sweep: one mfu.py process per point (mfu.py's own --sweep keeps a parent process holding the GPU) ------
if wanted sweep; then
    i=0
    for point in $SWEEP; do
        i=$((i + 1))
        IFS=: read -r attn chunk flags <<< "$point"
        flags=${flags//,/ }
        kernel=$attn; segments=16  # cudnn-mask: cuDNN with the document mask, not its packed layout
        if [ "$attn" = cudnn-mask ]; then kernel=cudnn; segments=0; fi
        if [[ "$attn" == cudnn-seg* ]]; then kernel=cudnn; segments=${attn#cudnn-seg}; fi
        step "sweep $attn/$chunk${flags:+ $flags}" "${POINT[@]}" -- $PYTHON benchmarks/mfu.py --recipe $BIG \
            --steps "$SWEEP_STEPS" --warmup "$SWEEP_WARMUP" --doc_len "$MFU_DOC_LEN" \
            --set model.attention="$kernel" model.attention_segments="$segments" model.loss_chunk_len="$chunk" \
            ${flags:+"run.xla_flags=$flags"} \
            --json "$SCRATCH/sweep_$i.json"
        if [ ! -s "$SCRATCH/sweep_$i.json" ]; then
            status=${SUMMARY[-1]#*|}; status=${status%%|*}
            if [ "$status" != skipped ] && [ -s "$SCRATCH/step.log" ]; then  # the error's last line
                status="$status: $(grep -v '^###' "$SCRATCH/step.log" | tail -1 | cut -c1-200 | tr -d '"\\')"
            fi
            printf '[{"recipe": "%s", "overrides": {"model.attention": "%s", "model.attention_segments": "%s", "model.loss_chunk_len": "%s", "run.xla_flags": "%s"}, "status": "%s"}]\n' \
                "$BIG" "$attn" "$segments" "$chunk" "$flags" "$status" > "$SCRATCH/sweep_$i.json"
        fi
    done
fi

# 4b. float8 projections: the mfu step with model.matmul=fp8 (a sweep point's steps) ---------------------
wanted fp8 && step fp8 "${FP8[@]}" -- $PYTHON benchmarks/mfu.py --recipe $BIG --steps "$SWEEP_STEPS" \
    --warmup "$SWEEP_WARMUP" --doc_len "$MFU_DOC_LEN" --set model.matmul=fp8 --json "$SCRATCH/sweep_fp8.json"
if ls "$SCRATCH"/sweep_*.json >/dev/null 2>&1; then  # the sweep's points and fp8's, one file (8 come back at most)
    $PYTHON - "$OUT/mfu_sweep.json" "$SCRATCH"/sweep_*.json <<'EOF' 2>&1 | tee -a "$LOG"
import json, sys
rows = [r for path in sys.argv[2:] for r in json.load(open(path))]
json.dump(rows, open(sys.argv[1], "w"), indent=2)
print(f"# {len(rows)} sweep points -> {sys.argv[1]}")
EOF
fi

# 4c. `make train`'s job on this machine (energy meter on NVML), then in float16 with loss scaling ----------
if wanted train; then
    for dtype in auto float16; do
        step "train $dtype" "${TRAIN[@]}" -- $PYTHON -m jaxlm.train --config=configs/tiny.py \
            --config.run.output_dir="$SCRATCH/runs" --config.run.name="$dtype" --config.model.dtype=$dtype \
            --config.profile.steps="$TRAIN_PROFILE" "${TRAIN_ARGS[@]}"
    done
    # the loop's own trace: how busy the device was between steps (the host's share of a small model's step)
    timeout 60 $PYTHON benchmarks/profile_step.py --trace "$SCRATCH/runs/auto/profile" --top 5 2>&1 | tee -a "$LOG"
    $PYTHON - "$OUT/train.json" "$SCRATCH/runs" <<'EOF' 2>&1 | tee -a "$LOG"
import json, pathlib, sys
runs = {}
for path in sorted(pathlib.Path(sys.argv[2]).glob("*/summary.json")):
    runs[path.parent.name] = json.loads(path.read_text())
    metrics = path.parent / "metrics.jsonl"
    if metrics.exists():  # the last training record (loss scale, energy), for the log
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        runs[path.parent.name]["last_metrics"] = next((r for r in reversed(rows) if "loss" in r), rows[-1] if rows else {})
json.dump(runs, open(sys.argv[1], "w"), indent=2)
for name, summary in runs.items():
    print(f"# train {name}:", json.dumps(summary)[:1500])
EOF
fi

# 5. checkpoint overhead (issue 4) --------------------------------------------------------------------------
wanted ckpt && step ckpt "${CKPT[@]}" -- $PYTHON benchmarks/checkpoint.py --recipes $CKPT_RECIPE "${CKPT_ARGS[@]}" \
    --json "$OUT/checkpoint.json"

# 6. HLO audit of the big recipe's step, if time is left; HLO text gzipped ---------------------------------
if wanted hlo; then
    # the audit only: with the profile, 8 files already come back (the device tool's limit)
    step hlo "${HLO[@]}" -- $PYTHON benchmarks/hlo_audit.py --recipe $BIG --json "$OUT/hlo_audit.json"
fi

# 7. the quickstart notebook in a real kernel, if time is left -------------------------------------------
if wanted notebook; then
    if ! $PYTHON -c 'import nbclient, ipykernel, matplotlib' 2>/dev/null && ls .whl/nb/*.whl >/dev/null 2>&1; then
        timeout -k 10 120 $PYTHON -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/nbsite .whl/nb/*.whl 2>&1 | grep -v "Running pip as the 'root' user" | tail -3 | tee -a "$LOG"
        export PYTHONPATH=/tmp/nbsite:$PYTHONPATH
    fi
    mkdir -p "$SCRATCH/runs"
    export JAXLM_RUNS_DIR=$SCRATCH/runs
    step notebook "${NB[@]}" -- $PYTHON benchmarks/run_notebook.py notebooks/01_quickstart.ipynb
fi

# summary ---------------------------------------------------------------------------------------------------
{
    echo
    echo "## summary (${SECONDS}s of ${BUDGET}s)"
    echo "| step | status | seconds | limit |"
    echo "|---|---|---|---|"
    for row in "${SUMMARY[@]}"; do echo "| ${row//|/ | } |"; done
} | tee -a "$LOG"
$PYTHON - "$OUT" <<'EOF' 2>&1 | tee -a "$LOG"
import json, os, sys
out = sys.argv[1]
rows = []
for name in ("mfu_1b.json", "mfu_sweep.json"):
    try:
        rows += [(name, r) for r in json.load(open(os.path.join(out, name)))]
    except (OSError, ValueError):
        pass
if rows:
    cols = ["attention", "segments", "matmul", "loss_chunk_len", "xla_flags", "doc_len", "attention_masked", "batch", "micro_batches", "compile_s", "step_s", "tokens_per_s", "mfu",
            "peak_memory_gib", "status"]
    print("\n| file | " + " | ".join(cols) + " |\n|" + "---|" * (len(cols) + 1))
    for name, r in rows:
        o = r.get("overrides", {})
        vals = {**r, "attention": r.get("attention", o.get("model.attention", "")),
                "loss_chunk_len": o.get("model.loss_chunk_len", "0"), "xla_flags": o.get("run.xla_flags", ""),
                "segments": o.get("model.attention_segments", "16"), "matmul": o.get("model.matmul", "")}
        cells = []
        for c in cols:
            v = vals.get(c, "")
            if c == "mfu":
                v = f"{100 * v:.1f}%" if isinstance(v, float) else "n/a" if r.get("status") == "ok" else ""
            cells.append(str(v)[:100])
        print(f"| {name} | " + " | ".join(cells) + " |")
try:
    for r in json.load(open(os.path.join(out, "checkpoint.json"))):
        print("\ncheckpoint:", json.dumps(r))
except (OSError, ValueError):
    pass
EOF
files=$(find "$OUT" -type f | wc -l)
log ""
log "## files in $OUT ($files; the device tool returns at most 8, 16 MiB each)"
find "$OUT" -type f -printf '%s\t%P\n' | sort -k2 | awk '{printf "%10.1f KiB  %s%s\n", $1/1024, $2, ($1 > 16*1024*1024 ? "  OVER 16 MiB" : "")}' | tee -a "$LOG"
rm -rf "$SCRATCH"
exit 0
