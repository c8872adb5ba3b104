// Package threadcpu measures a benchmark loop's own CPU time, for figures
// that must hold on a machine shared with other work.
package threadcpu
