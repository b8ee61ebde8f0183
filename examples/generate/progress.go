package main

import (
	"fmt"
	"io"
	"os"
	"runtime"
	"strconv"
	"strings"
	"time"
)

// progress draws a one-line bar on stderr while weights load.
type progress struct {
	w     io.Writer
	off   bool
	label string
	last  time.Time
	drawn bool
}

func newProgress(w io.Writer, off bool, label string) *progress {
	return &progress{w: w, off: off, label: label}
}

func (p *progress) update(done, total int64) {
	if p.off || total <= 0 || (time.Since(p.last) < 100*time.Millisecond && done < total) {
		return
	}
	p.last = time.Now()
	const width = 30
	n := int(int64(width) * done / total)
	fmt.Fprintf(p.w, "\r%s [%s%s] %3d%% %s", p.label, strings.Repeat("=", n), strings.Repeat(" ", width-n),
		100*done/total, formatBytes(done))
	p.drawn = true
}

func (p *progress) done() {
	if p.drawn {
		fmt.Fprintln(p.w)
	}
}

func formatBytes(n int64) string {
	switch {
	case n >= 1<<30:
		return fmt.Sprintf("%.2f GiB", float64(n)/(1<<30))
	case n >= 1<<20:
		return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20))
	}
	return fmt.Sprintf("%.1f KiB", float64(n)/(1<<10))
}

// peakHostBytes is the process's peak resident set (VmHWM) where Linux
// reports it, otherwise the memory the Go runtime obtained from the OS.
func peakHostBytes() int64 {
	if b, err := os.ReadFile("/proc/self/status"); err == nil {
		for _, line := range strings.Split(string(b), "\n") {
			if f := strings.Fields(line); len(f) >= 2 && f[0] == "VmHWM:" {
				if kb, err := strconv.ParseInt(f[1], 10, 64); err == nil {
					return kb << 10
				}
			}
		}
	}
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return int64(ms.Sys)
}
