package postgres

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/dispenser-dev/dispenser/schema"
)

// VersionTable is the table that records applied migrations.
const VersionTable = "dispenser_schema_migrations"

// lockKey is the pg_advisory_xact_lock key that serializes migrations across
// processes ("dispensr" in ASCII).
const lockKey int64 = 0x64697370656e7372

// Migrate applies the embedded PostgreSQL migrations that db does not have yet, in the
// order of Versions, and returns the versions it applied. Each migration runs
// in its own transaction together with its row in VersionTable, so a failed
// one leaves no trace. Migrate is idempotent and safe to run from several
// processes at once: each transaction holds an advisory lock and re-checks
// the version under it.
func Migrate(ctx context.Context, db *pgxpool.Pool) (applied []string, err error) {
	if err := migrate(ctx, db, "", "CREATE TABLE IF NOT EXISTS "+VersionTable+` (
		version    text        PRIMARY KEY,
		applied_at timestamptz NOT NULL DEFAULT now()
	)`); err != nil {
		return nil, err
	}
	for _, m := range schema.Load(schema.Postgres) {
		switch err := migrate(ctx, db, m.Name, m.SQL); {
		case errors.Is(err, errApplied):
		case err != nil:
			return applied, err
		default:
			applied = append(applied, m.Name)
		}
	}
	return applied, nil
}

// Missing returns the embedded migrations db has not applied, in order
// (all of them if it has none).
func Missing(ctx context.Context, db *pgxpool.Pool) ([]string, error) {
	var exists bool
	if err := db.QueryRow(ctx, "SELECT to_regclass($1) IS NOT NULL", VersionTable).Scan(&exists); err != nil {
		return nil, fmt.Errorf("schema: look up %s: %w", VersionTable, err)
	}
	if !exists {
		return schema.Versions(), nil
	}
	rows, err := db.Query(ctx, "SELECT version FROM "+VersionTable)
	if err != nil {
		return nil, fmt.Errorf("schema: read %s: %w", VersionTable, err)
	}
	applied := map[string]bool{}
	for rows.Next() {
		var v string
		if err := rows.Scan(&v); err != nil {
			rows.Close()
			return nil, fmt.Errorf("schema: read %s: %w", VersionTable, err)
		}
		applied[v] = true
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("schema: read %s: %w", VersionTable, err)
	}
	var missing []string
	for _, v := range schema.Versions() {
		if !applied[v] {
			missing = append(missing, v)
		}
	}
	return missing, nil
}

// errApplied means another process applied the migration first.
var errApplied = errors.New("schema: already applied")

// migrate runs sql in a transaction under the migration lock and records
// version, unless version is "" or already recorded (errApplied).
func migrate(ctx context.Context, db *pgxpool.Pool, version, sql string) (err error) {
	tx, err := db.Begin(ctx)
	if err != nil {
		return fmt.Errorf("schema: begin: %w", err)
	}
	defer func() {
		if err != nil {
			tx.Rollback(context.WithoutCancel(ctx))
		}
	}()
	if _, err := tx.Exec(ctx, "SELECT pg_advisory_xact_lock($1)", lockKey); err != nil {
		return fmt.Errorf("schema: lock: %w", err)
	}
	if version != "" {
		var done bool
		err := tx.QueryRow(ctx, "SELECT EXISTS (SELECT 1 FROM "+VersionTable+" WHERE version = $1)", version).Scan(&done)
		if err != nil {
			return fmt.Errorf("schema: look up version %s: %w", version, err)
		}
		if done {
			return errApplied
		}
	}
	// Without arguments pgx uses the simple protocol, which allows several
	// statements in one string.
	if _, err := tx.Exec(ctx, sql); err != nil {
		if version == "" {
			return fmt.Errorf("schema: create %s: %w", VersionTable, err)
		}
		return fmt.Errorf("schema: apply %s: %w", version, err)
	}
	if version != "" {
		if _, err := tx.Exec(ctx, "INSERT INTO "+VersionTable+" (version) VALUES ($1)", version); err != nil {
			return fmt.Errorf("schema: record %s: %w", version, err)
		}
	}
	if err := tx.Commit(ctx); err != nil {
		return fmt.Errorf("schema: commit %s: %w", version, err)
	}
	return nil
}
