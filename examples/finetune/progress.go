package main

import (
	"fmt"
	"io"
	"os"
	"strings"
)

// progress draws a one-line bar of training steps with the latest loss on
// stderr, when stderr is a terminal.
type progress struct {
	w     io.Writer
	off   bool
	drawn bool
}

func newProgress(w io.Writer, off bool) *progress {
	f, ok := w.(*os.File)
	if ok {
		st, err := f.Stat()
		ok = err == nil && st.Mode()&os.ModeCharDevice != 0
	}
	return &progress{w: w, off: off || !ok}
}

func (p *progress) update(step, total int, loss float64) {
	if p.off || total <= 0 {
		return
	}
	const width = 30
	n := width * step / total
	fmt.Fprintf(p.w, "\rtraining [%s%s] %d/%d loss %.4f", strings.Repeat("=", n), strings.Repeat(" ", width-n), step, total, loss)
	p.drawn = true
}

// clear erases the bar so that a line can be printed.
func (p *progress) clear() {
	if p.drawn {
		fmt.Fprint(p.w, "\r\033[K")
		p.drawn = false
	}
}
