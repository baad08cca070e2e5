# The two commands: `make demo` (set up everything, run a demo job you can watch) and `make test`.
SHELL := /bin/bash

.PHONY: demo test setup bench stop

demo:
	bash scripts/demo.sh

test:
	bash scripts/test.sh

setup:
	bash scripts/bootstrap.sh

bench:
	bash scripts/bench.sh

stop:
	bash scripts/demo.sh stop
