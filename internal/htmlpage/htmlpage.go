// Package htmlpage is what the worker's HTML pages share: the status page
// (/status, package worker) and Leaf's monitoring views /cache and /db
// (package leafhttp). They show one style and cut their tag lists at
// one limit, saying how many they left out.
package htmlpage

import (
	_ "embed"
	"html/template"
)

// TagLimit is the most tags a page lists: a worker may hold 100,000 tags.
const TagLimit = 200

//go:embed style.css
var style string

// Funcs are the template functions of the pages: {{style}} is the shared
// style sheet, for a <style> element.
var Funcs = template.FuncMap{"style": func() template.CSS { return template.CSS(style) }}

// Parse parses a page's template with Funcs; it panics on an error (the
// templates are the program's own).
func Parse(name, text string) *template.Template {
	return template.Must(template.New(name).Funcs(Funcs).Parse(text))
}

// Cut returns the first limit items and how many it left out.
func Cut[T any](items []T, limit int) (shown []T, more int) {
	if len(items) <= limit {
		return items, 0
	}
	return items[:limit], len(items) - limit
}
