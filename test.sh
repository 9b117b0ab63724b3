#!/usr/bin/env bash
# The README's test command. On a Debian/Ubuntu machine it installs what
# the tests need and the machine lacks (apt-get, as root or with sudo),
# then runs every test: `go test -race ./...` of the service's module and
# the tests of the Helm chart's module in deploy/helm (not part of ./...).
#
#   ./test.sh               set up if needed, then test
#   ./test.sh --setup-only  set up only
#   ./test.sh -run TestX    extra arguments go to both go test runs
#
# Who has the tools may run `go test ./...` directly: a test whose tool is
# missing fails, naming the Debian package to install. .ci/run calls this.
set -euo pipefail
cd "$(dirname "$0")"
export PATH="$PATH:/usr/local/go/bin"

missing=()
# need PACKAGE WHY CHECK...: PACKAGE is missing unless one CHECK succeeds.
need() {
	local pkg=$1 why=$2
	shift 2
	local check
	for check in "$@"; do
		if eval "$check" >/dev/null 2>&1; then
			return
		fi
	done
	echo "test.sh: missing $pkg ($why)"
	missing+=("$pkg")
}
need postgresql "the tests' throwaway PostgreSQL (testenv)" \
	'command -v initdb' 'ls /usr/lib/postgresql/*/bin/initdb'
need gcc "go test -race needs cgo" 'command -v gcc'
need libc6-dev "go test -race needs the C library's headers" 'test -e /usr/include/stdlib.h'
need podman "deploy.TestImage builds the container image" 'command -v podman'
need prometheus "promtool for deploy.TestAlertRules, prometheus for deploy.TestDashboardQueries" \
	'command -v promtool && command -v prometheus'
need chromium "worker.TestStatusPageInChromium" 'command -v chromium'
need mariadb-server "the MariaDB segment store's tests" \
	'command -v mariadbd' 'test -x /usr/sbin/mariadbd' 'command -v mysqld' 'test -x /usr/sbin/mysqld'
need wrk "the HTTP API's load benchmark" 'command -v wrk'

if ((${#missing[@]})); then
	sudo=()
	if [ "$(id -u)" != 0 ]; then
		if ! command -v sudo >/dev/null 2>&1; then
			echo "test.sh: not root and no sudo: install ${missing[*]} (apt-get install --no-install-recommends ${missing[*]})" >&2
			exit 1
		fi
		sudo=(sudo)
	fi
	echo "test.sh: installing ${missing[*]}"
	export DEBIAN_FRONTEND=noninteractive
	"${sudo[@]}" apt-get update -q
	"${sudo[@]}" apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

if [ "${1:-}" = --setup-only ]; then
	exit 0
fi

go version
status=0
echo "test.sh: go test -race ./... $*"
go test -race "$@" ./... || status=$?
# The chart's module compiles Helm and the Kubernetes libraries; its tests
# are sequential and start no goroutines of their own (the worker they run
# is a separate process), so they run without -race, which would only make
# that compilation slower (222 s without, 388 s with, from an empty cache on
# a busy 2-core machine).
echo "test.sh: (cd deploy/helm && go test ./...) $*"
(cd deploy/helm && go test "$@" ./...) || status=$?
exit "$status"
