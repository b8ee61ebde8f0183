//go:build race

package tensor_test

// raceEnabled reports a -race build, in which sync.Pool drops items at
// random, so that allocation counts mean nothing.
const raceEnabled = true
