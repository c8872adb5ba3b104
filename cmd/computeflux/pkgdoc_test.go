package main

import (
	"go/parser"
	"go/token"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestPackageDocs checks that every package in the module has a doc comment.
func TestPackageDocs(t *testing.T) {
	root := filepath.Join("..", "..")
	seen := 0
	err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if !d.IsDir() {
			return nil
		}
		name := d.Name()
		if path != root && (strings.HasPrefix(name, ".") || name == "testdata" || name == "node_modules") {
			return filepath.SkipDir
		}
		// One package per directory (its non-test files); a file's package
		// clause and doc comment are all that is read.
		entries, err := os.ReadDir(path)
		if err != nil {
			return err
		}
		pkgName, files, documented := "", 0, false
		for _, e := range entries {
			n := e.Name()
			if e.IsDir() || !strings.HasSuffix(n, ".go") || strings.HasSuffix(n, "_test.go") {
				continue
			}
			f, err := parser.ParseFile(token.NewFileSet(), filepath.Join(path, n), nil, parser.PackageClauseOnly|parser.ParseComments)
			if err != nil {
				return err
			}
			pkgName = f.Name.Name
			files++
			if f.Doc != nil && strings.TrimSpace(f.Doc.Text()) != "" {
				documented = true
			}
		}
		if files > 0 {
			seen++
			if !documented {
				t.Errorf("package %s in %s has no doc comment", pkgName, path)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if seen < 5 {
		t.Fatalf("walked %d packages, expected the whole module", seen)
	}
}
