package tensor

import (
	"errors"
	"fmt"
)

// The helpers below find a backend's optional capabilities. Call them
// rather than type-asserting: they look behind a front from Checked (and
// any other wrapper with an Unwrap() Backend method), where a type
// assertion would miss the capability and silently take the slow path.

// capability returns the first of b and the backends behind it that
// implements C.
func capability[C any](b Backend) (C, bool) {
	for b != nil {
		if c, ok := b.(C); ok {
			return c, true
		}
		u, ok := b.(interface{ Unwrap() Backend })
		if !ok {
			break
		}
		b = u.Unwrap()
	}
	var zero C
	return zero, false
}

// Sync waits for b's queued work when b runs asynchronously (Syncer) and
// returns its first asynchronous error; otherwise it returns nil.
func Sync(b Backend) error {
	if s, ok := capability[Syncer](b); ok {
		return s.Sync()
	}
	return nil
}

// Pinned returns b's page-locked host allocator, if it has one.
func Pinned(b Backend) (PinnedAllocator, bool) { return capability[PinnedAllocator](b) }

// AsyncUpload returns b's asynchronous copy engine, if it has one.
func AsyncUpload(b Backend) (AsyncUploader, bool) { return capability[AsyncUploader](b) }

// Managed returns b's unified-memory allocator, if it has one.
func Managed(b Backend) (ManagedAllocator, bool) { return capability[ManagedAllocator](b) }

// FreeMemory reports the free and total bytes of b's device (MemoryInfo).
// A backend that cannot tell returns an error wrapping
// errors.ErrUnsupported.
func FreeMemory(b Backend) (free, total int64, err error) {
	mi, ok := capability[MemoryInfo](b)
	if !ok {
		return 0, 0, fmt.Errorf("tensor: %s cannot report its memory: %w", b.Name(), errors.ErrUnsupported)
	}
	return mi.MemInfo()
}
