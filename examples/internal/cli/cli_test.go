package cli

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/strata-llm/strata/arch"
	"github.com/strata-llm/strata/internal/filetest"
)

// The signal tests run Main in a child process (this test binary again),
// which behaves as helperMode says.
const helperMode = "STRATA_CLI_HELPER"

func TestMain(m *testing.M) {
	switch os.Getenv(helperMode) {
	case "":
		os.Exit(m.Run())
	case "returns": // stops when its context is cancelled
		Main("helper", func(ctx context.Context, _ []string, stdout, _ io.Writer) error {
			fmt.Fprintln(stdout, "ready")
			<-ctx.Done()
			return fmt.Errorf("step 3: %w", ctx.Err())
		})
	case "stuck": // ignores its context after seeing it cancelled
		Main("helper", func(ctx context.Context, _ []string, stdout, _ io.Writer) error {
			fmt.Fprintln(stdout, "ready")
			<-ctx.Done()
			fmt.Fprintln(stdout, "cancelled")
			for {
				time.Sleep(time.Hour)
			}
		})
	}
}

// TestSignals: the first SIGINT or SIGTERM cancels the command's context
// and the command's error is reported as the interruption, in one line,
// exit status 1; a command stuck after the first signal is ended by the
// second.
func TestSignals(t *testing.T) {
	if runtime.GOOS == "windows" {
		t.Skip("no signals to send on windows")
	}
	for _, tc := range []struct {
		mode    string
		sig     syscall.Signal
		signals int
		status  int    // exit status, or -1 for death by the signal
		stderr  string // the one line on stderr
	}{
		{"returns", syscall.SIGINT, 1, 1, "helper: interrupted by SIGINT"},
		{"returns", syscall.SIGTERM, 1, 1, "helper: interrupted by SIGTERM"},
		{"stuck", syscall.SIGINT, 2, -1, ""},
		{"stuck", syscall.SIGTERM, 2, -1, ""},
	} {
		t.Run(fmt.Sprintf("%s/%v", tc.mode, tc.sig), func(t *testing.T) {
			cmd := exec.Command(os.Args[0])
			cmd.Env = append(os.Environ(), helperMode+"="+tc.mode)
			var stderr strings.Builder
			cmd.Stderr = &stderr
			out, err := cmd.StdoutPipe()
			if err != nil {
				t.Fatal(err)
			}
			if err := cmd.Start(); err != nil {
				t.Fatal(err)
			}
			lines := bufio.NewScanner(out)
			expect := func(want string) {
				t.Helper()
				if !lines.Scan() || lines.Text() != want {
					cmd.Process.Kill()
					t.Fatalf("child said %q, want %q", lines.Text(), want)
				}
			}
			expect("ready")
			cmd.Process.Signal(tc.sig)
			if tc.signals == 2 {
				expect("cancelled")
				cmd.Process.Signal(tc.sig)
			}
			done := make(chan error, 1)
			go func() {
				io.Copy(io.Discard, out)
				done <- cmd.Wait()
			}()
			select {
			case <-done:
			case <-time.After(20 * time.Second):
				cmd.Process.Kill()
				t.Fatal("the child did not stop")
			}
			ws := cmd.ProcessState.Sys().(syscall.WaitStatus)
			if tc.status < 0 {
				if !ws.Signaled() || ws.Signal() != tc.sig {
					t.Errorf("child ended with %v, want death by %v", cmd.ProcessState, tc.sig)
				}
				return
			}
			if ws.ExitStatus() != tc.status || strings.TrimSuffix(stderr.String(), "\n") != tc.stderr {
				t.Errorf("exit status %d, stderr %q; want %d, %q", ws.ExitStatus(), stderr.String(), tc.status, tc.stderr)
			}
		})
	}
}

// TestOpenModelEmbeddedInPlace: the default model opens with nothing
// written under the temporary directory.
func TestOpenModelEmbeddedInPlace(t *testing.T) {
	tmp := t.TempDir()
	t.Setenv("TMPDIR", tmp)
	lm, err := OpenModel("")
	if err != nil {
		t.Fatal(err)
	}
	tok, err := LoadTokenizer(lm)
	if err != nil || tok == nil {
		t.Fatalf("tokenizer %v, %v", tok, err)
	}
	if _, err := lm.ReadTensor(context.Background(), arch.EmbedName); err != nil {
		t.Fatal(err)
	}
	lm.Close()
	if ents, _ := os.ReadDir(tmp); len(ents) != 0 {
		t.Errorf("the temporary directory holds %v", ents)
	}
	if _, err := OpenModel(filepath.Join(tmp, "none")); err == nil || strings.Contains(err.Error(), "\n") {
		t.Errorf("missing model directory: %v", err)
	}
}

// TestCheckOutputs: outputs that are inputs, that cannot be written, or
// that name one file twice are usage errors before any work, and nothing
// is written.
func TestCheckOutputs(t *testing.T) {
	dir := t.TempDir()
	in := filepath.Join(dir, "data.txt")
	os.WriteFile(in, []byte("x"), 0o644)
	link := filepath.Join(dir, "link")
	os.Symlink(in, link)
	old := filepath.Join(dir, "old.bin")
	os.WriteFile(old, []byte("y"), 0o644)
	new := filepath.Join(dir, "new.bin")
	for _, tc := range []struct {
		name    string
		outputs [][2]string
		ok      bool
	}{
		{"new and old files", [][2]string{{"-a", new}, {"-b", old}, {"-c", ""}}, true},
		{"an input", [][2]string{{"-a", in}}, false},
		{"an input through a link", [][2]string{{"-a", link}}, false},
		{"the input directory", [][2]string{{"-a", dir}}, false},
		{"no such directory", [][2]string{{"-a", filepath.Join(dir, "no", "x")}}, false},
		{"twice", [][2]string{{"-a", new}, {"-b", new}}, false},
		{"twice, unclean", [][2]string{{"-a", new}, {"-b", dir + "/./new.bin"}}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			before := filetest.Tree(t, dir)
			err := CheckOutputs(tc.outputs, []string{in, dir})
			if (err == nil) != tc.ok || err != nil && (!IsUsage(err) || strings.Contains(err.Error(), "\n")) {
				t.Fatalf("CheckOutputs = %v, want ok %v (a one-line usage error)", err, tc.ok)
			}
			filetest.SameTree(t, dir, before)
			filetest.NoTemps(t, dir)
		})
	}
}

// TestMessageOneLine checks the line Main prints for errors whose text
// spans lines: a model directory named with a line break, and a wrapped
// error of several lines.
func TestMessageOneLine(t *testing.T) {
	_, dirErr := OpenModel(filepath.Join(t.TempDir(), "two\nlines"))
	for _, err := range []error{
		dirErr,
		UsageError{fmt.Errorf("config: %w", errors.New("yaml: unmarshal errors:\n  line 2: field x not found"))},
		errors.New("plain"),
	} {
		if err == nil {
			t.Fatal("no error")
		}
		msg := Message("generate", err)
		if strings.ContainsAny(msg, "\r\n") || !strings.HasPrefix(msg, "generate: ") {
			t.Errorf("Message(%q) = %q", err, msg)
		}
	}
	if got := Message("generate", errors.New("a:\n b\nc")); got != "generate: a: b; c" {
		t.Errorf("Message = %q", got)
	}
}
