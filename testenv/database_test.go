package testenv

import (
	"context"
	"strings"
	"testing"
)

func TestNewDatabase(t *testing.T) {
	ctx := context.Background()
	url1, drop1, err := NewDatabase(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { drop1() })
	url2, drop2, err := NewDatabase(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { drop2() })
	if url1 == url2 {
		t.Fatalf("two calls gave the same URL %s", url1)
	}
	name := queryString(t, connect(t, url1), "SELECT current_database()")
	if !strings.HasPrefix(name, "dispenser_test_") {
		t.Errorf("database name %q, want the dispenser_test_ prefix", name)
	}
	admin := connect(t, Postgres(t)) // any database on the same server
	if !databaseExists(t, admin, name) {
		t.Fatalf("database %s does not exist after NewDatabase", name)
	}
	if err := drop1(); err != nil {
		t.Fatalf("drop: %v", err)
	}
	if databaseExists(t, admin, name) {
		t.Errorf("database %s still exists after drop", name)
	}
	if err := drop1(); err != nil {
		t.Errorf("second drop: %v", err)
	}
}

func TestNewDatabaseNeedsRun(t *testing.T) {
	running.Store(false)
	defer running.Store(true)
	url, drop, err := NewDatabase(context.Background())
	if err == nil || !strings.Contains(err.Error(), "testenv.Run") {
		t.Errorf("NewDatabase outside Run = %q, %v, %v, want an error naming testenv.Run", url, drop != nil, err)
	}
}
