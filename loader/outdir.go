package loader

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"regexp"
	"slices"

	"github.com/strata-llm/strata/internal/atomicfile"
)

// ModelFiles are the names of the files, besides the weights, that make up
// a model directory written by Synthesize or nn's Params.Save: the config,
// the generation config and the tokenizer files.
var ModelFiles = []string{
	ConfigFile, "generation_config.json",
	TokenizerFile, TokenizerConfig, "special_tokens_map.json", "tokenizer.model",
}

// weightFile matches the weight files and index of a model directory.
var weightFile = regexp.MustCompile(`^model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?$`)

// IsModelFile reports whether name (a base name) is one of a model
// directory's files: a weight file, the index, or one of ModelFiles.
func IsModelFile(name string) bool {
	return weightFile.MatchString(name) || slices.Contains(ModelFiles, name)
}

// ErrNotModelDir is wrapped by the error CheckModelDir returns for a
// directory that holds something else than a model.
var ErrNotModelDir = errors.New("holds files that are not part of a model")

// CheckModelDir reports whether a model can be written into dir as a
// whole by ReplaceModelDir without losing anything but a model: dir does
// not exist, or it is a directory holding nothing but model files
// (IsModelFile). hasModel says whether it holds any already.
func CheckModelDir(dir string) (hasModel bool, err error) {
	st, err := os.Stat(dir)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return false, nil
	case err != nil:
		return false, fmt.Errorf("loader: %w", err)
	case !st.IsDir():
		return false, fmt.Errorf("loader: %s: not a directory", dir)
	}
	entries, err := os.ReadDir(dir)
	if err != nil {
		return false, fmt.Errorf("loader: %w", err)
	}
	for _, e := range entries {
		if !IsModelFile(e.Name()) || !e.Type().IsRegular() {
			return false, fmt.Errorf("loader: %s %w (%s): write the model into a new or empty directory", dir, ErrNotModelDir, e.Name())
		}
		hasModel = true
	}
	return hasModel, nil
}

// ReplaceModelDir writes a model directory as a whole: fill writes the
// model into a fresh temporary directory beside dir, which then takes
// dir's place (atomicfile.ReplaceDir). An earlier model in dir is removed
// only once the new one is complete; when fill or any step fails, dir is
// as it was and no temporary directory remains. dir must pass
// CheckModelDir, so that nothing but a model is replaced.
func ReplaceModelDir(dir string, fill func(tmp string) error) error {
	if _, err := CheckModelDir(dir); err != nil {
		return err
	}
	var fillErr error
	err := atomicfile.ReplaceDir(dir, func(tmp string) error {
		fillErr = fill(tmp)
		return fillErr
	})
	if err != nil && err != fillErr {
		return fmt.Errorf("loader: write %s: %w", dir, err)
	}
	return err
}
