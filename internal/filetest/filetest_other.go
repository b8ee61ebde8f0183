//go:build !unix

package filetest

import "testing"

// Mkfifo skips the test: this system has no named pipes.
func Mkfifo(t testing.TB, path string) { t.Skip("no named pipes on this system") }

// LimitFileSize skips the test: this system has no file size limit.
func LimitFileSize(t testing.TB, n uint64) bool {
	t.Skip("no file size limit on this system")
	return false
}
