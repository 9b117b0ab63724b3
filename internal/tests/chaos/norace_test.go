//go:build !race

package chaos

// raceBuild reports whether the test binary was built with -race.
const raceBuild = false
