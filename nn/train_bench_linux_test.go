//go:build linux

package nn

import (
	"syscall"
	"time"
)

// cpuTime is the user and system CPU time the process has used, which
// measures work even when other processes compete for the cores.
func cpuTime() time.Duration {
	var ru syscall.Rusage
	if syscall.Getrusage(syscall.RUSAGE_SELF, &ru) != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
