//go:build race

package nn

// The race detector slows the fault sweeps about tenfold: sample fewer
// points.
func init() { raceEnabled = true }
