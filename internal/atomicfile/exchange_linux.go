package atomicfile

import (
	"errors"
	"os"

	"golang.org/x/sys/unix"
)

// exchange swaps the directory entries a and b atomically where the file
// system can (renameat2 RENAME_EXCHANGE), else with two renames.
func exchange(a, b string) error {
	err := unix.Renameat2(unix.AT_FDCWD, a, unix.AT_FDCWD, b, unix.RENAME_EXCHANGE)
	if errors.Is(err, unix.EINVAL) || errors.Is(err, unix.ENOSYS) || errors.Is(err, unix.EOPNOTSUPP) {
		return renameSwap(a, b)
	}
	if err != nil {
		return &os.LinkError{Op: "exchange", Old: a, New: b, Err: err}
	}
	return nil
}
