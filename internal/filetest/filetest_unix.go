//go:build unix

package filetest

import (
	"bytes"
	"os"
	"os/exec"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
)

// Mkfifo makes a named pipe at path, or skips the test where it cannot.
func Mkfifo(t testing.TB, path string) {
	t.Helper()
	if err := syscall.Mkfifo(path, 0o644); err != nil {
		t.Skip("no named pipes here:", err)
	}
}

// LimitFileSize runs the rest of the test with every write past n bytes
// into any file failing (EFBIG), as on a full disk. The limit is
// process-wide, and the test framework writes files of its own, so the
// test is run again by itself in a child process that sets the limit:
// LimitFileSize returns true there, and false in the parent once the child
// has passed (or fails or skips the test as the child did); the caller
// returns at once when it gets false.
//
//	if !filetest.LimitFileSize(t, 1<<14) {
//		return
//	}
func LimitFileSize(t testing.TB, n uint64) bool {
	t.Helper()
	if v := os.Getenv(limitEnv); v != "" {
		lim, err := strconv.ParseUint(v, 10, 64)
		if err != nil {
			t.Fatalf("%s=%q: %v", limitEnv, v, err)
		}
		var old syscall.Rlimit
		if err := syscall.Getrlimit(syscall.RLIMIT_FSIZE, &old); err != nil {
			t.Fatal(err)
		}
		if err := syscall.Setrlimit(syscall.RLIMIT_FSIZE, &syscall.Rlimit{Cur: lim, Max: old.Max}); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { syscall.Setrlimit(syscall.RLIMIT_FSIZE, &old) })
		return true
	}
	var pattern []string
	for _, part := range strings.Split(t.Name(), "/") {
		pattern = append(pattern, "^"+regexp.QuoteMeta(part)+"$")
	}
	cmd := exec.Command(os.Args[0], "-test.run="+strings.Join(pattern, "/"), "-test.v=true", "-test.count=1")
	cmd.Env = append(os.Environ(), limitEnv+"="+strconv.FormatUint(n, 10))
	out, err := cmd.CombinedOutput()
	switch {
	case err != nil:
		t.Fatalf("with writes limited to %d bytes (in a child process): %v\n%s", n, err, out)
	case bytes.Contains(out, []byte("--- SKIP: "+t.Name())):
		t.Skipf("skipped in the child process:\n%s", out)
	case !bytes.Contains(out, []byte("--- PASS: "+t.Name())):
		t.Fatalf("the child process did not run %s:\n%s", t.Name(), out)
	}
	return false
}

const limitEnv = "STRATA_FILETEST_FSIZE"
