#!/usr/bin/env bash
# Build DeepGEMM from source for the recipe's `deep_gemm` (output and grad_input on DeepGEMM's SM90 kernel), at
# the commits docs/benchmarks.md measured (section 0a), then print the PYTHONPATH that makes it importable.
#
#   bash benchmarks/build_deep_gemm.sh [DIR]
#
# DIR: a DeepGEMM checkout with its submodules (third-party/cutlass, third-party/fmt); cloned there at the pinned
# commit when it does not exist (default ./DeepGEMM). Needs nvcc and a CUDA torch; a built DIR is left as it is.
# The extension links libstdc++ statically with its symbols hidden: linked as setup.py links it, its first GEMM
# segfaulted in libstdc++'s locale code beside the torch 2.11 wheel (GCC 13.3).
set -euo pipefail
DEEP_GEMM_COMMIT=54e2261  # with CUTLASS f3fde58 and fmt 553ec11, its submodules
dir=${1:-DeepGEMM}
if [ ! -d "$dir" ]; then
  git clone https://github.com/deepseek-ai/DeepGEMM "$dir"
  git -C "$dir" checkout -q "$DEEP_GEMM_COMMIT"
  git -C "$dir" submodule update -q --init --recursive
fi
cd "$dir"
for sub in third-party/cutlass/include/cutlass third-party/cutlass/include/cute third-party/fmt/include/fmt; do
  [ -d "$sub" ] || { echo "build_deep_gemm.sh: $PWD/$sub is missing (the checkout's submodules)" >&2; exit 2; }
done
if ! ls deep_gemm/_C*.so >/dev/null 2>&1; then
  # DeepGEMM compiles its kernels at first use and looks for CUTLASS beside its own headers
  ln -sfn "$PWD/third-party/cutlass/include/cutlass" deep_gemm/include/cutlass
  ln -sfn "$PWD/third-party/cutlass/include/cute" deep_gemm/include/cute
  start=$(date +%s)
  LDFLAGS="-static-libstdc++ -static-libgcc -Wl,--exclude-libs,ALL" python3 setup.py build >build.log 2>&1 \
    || { tail -30 build.log >&2; echo "build_deep_gemm.sh: the build failed; $PWD/build.log has the whole log" >&2; exit 1; }
  so=$(find build -name "_C*.so" | head -1)
  ln -sf "../$so" deep_gemm/
  echo "DeepGEMM built in $(( $(date +%s) - start )) s: $PWD/$so" >&2
fi
echo "export PYTHONPATH=$PWD\${PYTHONPATH:+:\$PYTHONPATH}"
