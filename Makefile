# Everything a fresh machine needs: `make demo` runs the main job, `make test`
# runs the suite (what .ci/run runs). Both set up the virtual environment and
# build the C libraries first.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: all setup build build-release build-asan build-tsan build-system-headers typecheck-view demo \
        test check tsan lint clean ptx

all: build

# An editable install compiles nothing (pyproject.toml): the libraries come
# from the build trees below.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	touch $@

setup: $(STAMP)

# CMake takes cuda.h from the .venv's nvidia-cuda-runtime wheel.
CMAKE_PYTHON = -DPython_EXECUTABLE=$(CURDIR)/$(BIN)/python

# build/ is the release build (demo, GPU runs); build-asan/ the ASan+UBSan
# build that the suite's C-facing tests run against. The test hooks
# (CUINTERPOSE_TEST_HOOKS: a settings.c variable that changes whom the shim
# trusts, one that holds a thread back) are in the sanitizer builds only.
build: build-release build-asan

build-release: $(STAMP)
	cmake -S . -B build -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCUINTERPOSE_TEST_HOOKS=OFF $(CMAKE_PYTHON) >/dev/null
	cmake --build build -j2

build-asan: $(STAMP)
	cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=Debug -DCUINTERPOSE_SANITIZE=ON -DCUINTERPOSE_TEST_HOOKS=ON $(CMAKE_PYTHON) >/dev/null
	cmake --build build-asan -j2

# build-tsan/: the ThreadSanitizer build (the gate, the listener, the staging pool
# and the simulator's streams are threads) that `make tsan` runs the threaded tests on.
build-tsan: $(STAMP)
	cmake -S . -B build-tsan -DCMAKE_BUILD_TYPE=Debug -DCUINTERPOSE_TSAN=ON -DCUINTERPOSE_TEST_HOOKS=ON $(CMAKE_PYTHON) >/dev/null
	cmake --build build-tsan -j2

# The H200 machines' toolkit has CUDA 13.0's cuda.h, older than the wheel's: where a
# system toolkit is installed, both libraries must build against its header too.
SYSTEM_CUDA_INCLUDE ?= /usr/local/cuda/include

build-system-headers: $(STAMP)
	@if [ -f $(SYSTEM_CUDA_INCLUDE)/cuda.h ]; then \
	  cmake -S . -B build-system-headers -DCUINTERPOSE_CUDA_INCLUDE=$(SYSTEM_CUDA_INCLUDE) >/dev/null && \
	  cmake --build build-system-headers -j2 >/dev/null && \
	  echo "built against $(SYSTEM_CUDA_INCLUDE)/cuda.h"; \
	else echo "no $(SYSTEM_CUDA_INCLUDE)/cuda.h: skipped the build against system headers"; fi

# mypy checks the package as it is imported (cuinterpose, cuinterpose.engine,
# cuinterpose.phases): a view of links that puts the three folders where the
# installed package has them.
TYPECHECK := build/typecheck

typecheck-view:
	rm -rf $(TYPECHECK) && mkdir -p $(TYPECHECK)/cuinterpose
	ln -s $(CURDIR)/frontends/* $(CURDIR)/engine $(CURDIR)/phases $(TYPECHECK)/cuinterpose/

lint: $(STAMP) typecheck-view
	$(BIN)/ruff check engine phases frontends tests bench tools backend
	$(BIN)/ruff format --check engine phases frontends
	cd $(TYPECHECK) && $(CURDIR)/$(BIN)/mypy --config-file $(CURDIR)/pyproject.toml -p cuinterpose

demo: build-release
	$(BIN)/cuinterpose demo

# The suite in TEST_WORKERS processes (pytest-xdist): every test has its own control
# directory and simulated-driver namespace, so they run side by side.
TEST_WORKERS ?= 2

test: build build-system-headers lint
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS)

# The inner loop (under a minute on two cores): lint, types, and the tests that start
# no shimmed process (the engine, the machines, the wire pin), less those marked slow.
# CHECK_TESTS="tests/engine tests/sim" adds the simulated driver's units (about 40 s
# more). `make test` is the whole suite.
CHECK_TESTS ?= tests/engine

check: build lint
	$(BIN)/python -m pytest -q -m "not slow" $(CHECK_TESTS)

# The tests marked `threads` (the gate, the listener, the staging pool, the simulator's
# streams) against build-tsan/; ThreadSanitizer runs them some 3 times slower.
# The kept host copy's hash kernel as the PTX the shim carries (needs nvcc; CI and users
# build from the committed header; tests/shim/test_keep_hash.py checks it is current).
NVCC ?= /usr/local/cuda/bin/nvcc
ptx:
	tools/gen_keep_hash_ptx.sh $(NVCC) > shim_c/keep_hash_ptx.h.new
	mv shim_c/keep_hash_ptx.h.new shim_c/keep_hash_ptx.h

tsan: build-tsan
	CUINTERPOSE_TEST_DRIVER=tsan $(BIN)/python -m pytest -q -m threads --timeout 300 tests/sim tests/shim

clean:
	rm -rf build build-asan build-tsan build-system-headers dist $(VENV)
