//go:build race

package paging

// The race detector slows the fault sweeps about tenfold: sample fewer
// points.
func init() { raceEnabled = true }
