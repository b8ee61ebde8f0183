package cli

import (
	"fmt"
	"io"
	"os"
	"strings"
	"sync"
	"time"
)

// IsTerminal reports whether w is a terminal (a character device), where
// a progress bar redrawn with \r makes sense; a file, a pipe or a buffer is
// not.
func IsTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	st, err := f.Stat()
	return err == nil && st.Mode()&os.ModeCharDevice != 0
}

// Progress is a one-line bar that a command redraws on stderr while it
// works, only when stderr is a terminal: written to a log file or a pipe it
// draws nothing, so that a log holds no frames of \r. It is safe for
// concurrent use (loaders report from several goroutines).
type Progress struct {
	mu    sync.Mutex
	w     io.Writer
	on    bool
	label string
	every time.Duration
	last  time.Time
	drawn bool
}

// NewProgress returns a bar labelled label on w, drawn when w is a
// terminal and quiet is false.
func NewProgress(w io.Writer, label string, quiet bool) *Progress {
	return newProgress(w, label, !quiet && IsTerminal(w))
}

func newProgress(w io.Writer, label string, on bool) *Progress {
	return &Progress{w: w, on: on, label: label, every: 100 * time.Millisecond}
}

// On reports whether the bar is drawn.
func (p *Progress) On() bool { return p.on }

// Update redraws the bar at done of total with detail after it, at most
// ten times a second (the last update, done == total, always).
func (p *Progress) Update(done, total int64, detail string) {
	if !p.on || total <= 0 {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	now := time.Now()
	if now.Sub(p.last) < p.every && done < total {
		return
	}
	p.last = now
	const width = 30
	n := int(width * min(max(done, 0), total) / total)
	fmt.Fprintf(p.w, "\r\033[K%s [%s%s] %s", p.label, strings.Repeat("=", n), strings.Repeat(" ", width-n), detail)
	p.drawn = true
}

// Bytes is Update for a count of bytes: the percentage and the size done.
func (p *Progress) Bytes(done, total int64) {
	if !p.on || total <= 0 {
		return
	}
	p.Update(done, total, fmt.Sprintf("%3d%% %s", 100*done/total, FormatBytes(done)))
}

// Clear erases the bar, so that a line can be printed; the next Update
// draws it again.
func (p *Progress) Clear() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.drawn {
		fmt.Fprint(p.w, "\r\033[K")
		p.drawn = false
		p.last = time.Time{}
	}
}

// Done ends the bar: the line it is on is kept, followed by a newline.
func (p *Progress) Done() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.drawn {
		fmt.Fprintln(p.w)
		p.drawn = false
	}
}

// FormatBytes writes n as KiB, MiB or GiB.
func FormatBytes(n int64) string {
	switch {
	case n >= 1<<30:
		return fmt.Sprintf("%.2f GiB", float64(n)/(1<<30))
	case n >= 1<<20:
		return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20))
	}
	return fmt.Sprintf("%.1f KiB", float64(n)/(1<<10))
}
