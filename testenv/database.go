package testenv

import (
	"context"
	"errors"
	"time"
)

// NewDatabase creates a new, empty database on the server that Postgres
// uses and returns its connection URL and a function that drops it. It is
// Postgres for code without a testing.TB, such as Example functions: the
// caller drops the database itself. Like Postgres it needs the package's
// tests to run under Run, which stops the server when they end; it returns
// an error otherwise, and drop fails once the server is stopped.
func NewDatabase(ctx context.Context) (url string, drop func() error, err error) {
	if !running.Load() {
		return "", nil, errors.New("testenv: NewDatabase needs the package's tests to run under testenv.Run: add func TestMain(m *testing.M) { os.Exit(testenv.Run(m)) }")
	}
	admin, err := sharedServer()
	if err != nil {
		return "", nil, err
	}
	url, name, err := createDatabase(ctx, admin)
	if err != nil {
		return "", nil, err
	}
	drop = func() error {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		return dropDatabase(ctx, admin, name)
	}
	return url, drop, nil
}
