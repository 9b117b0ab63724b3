package client

// NewTokenForTest returns a request token, for benchmarks.
func NewTokenForTest() string { return newToken() }
