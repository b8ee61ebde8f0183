//go:build !unix

package loader

import (
	"errors"
	"os"
)

// mapFile cannot map files on this platform: reads go through pread.
func mapFile(f *os.File, size int64) ([]byte, error) {
	return nil, errors.New("loader: mapping files is not supported on this platform")
}

func unmapFile(b []byte) error { return nil }
