package main

import (
	"os"
	"runtime"
	"strconv"
	"strings"
)

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
