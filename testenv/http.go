package testenv

import (
	"io"
	"net/http"
	"testing"
)

// HTTPGet GETs url and returns the response's status code and body; it
// fails tb if the request or the body's read fails.
func HTTPGet(tb testing.TB, url string) (code int, body string) {
	tb.Helper()
	resp, err := http.Get(url)
	if err != nil {
		tb.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		tb.Fatal(err)
	}
	return resp.StatusCode, string(b)
}
