package worker

import "syscall"

// networkFileSystems are the file systems (statfs(2) f_type) on which
// the data directory's lock may not be honoured across machines.
var networkFileSystems = map[int64]string{
	0x6969:     "NFS",
	0x517b:     "SMB",
	0xff534d42: "CIFS",
	0xfe534d42: "SMB2",
	0x5346414f: "AFS",
	0x6b414653: "AFS",
	0x73757245: "Coda",
	0x564c:     "NCP",
}

// statfsType returns the file system type of path (a variable: tests make
// a directory look remote).
var statfsType = func(path string) (int64, error) {
	var st syscall.Statfs_t
	if err := syscall.Statfs(path, &st); err != nil {
		return 0, err
	}
	return int64(st.Type), nil
}

// networkFS says whether dir is on a network file system, and which.
func networkFS(dir string) (string, bool) {
	t, err := statfsType(dir)
	if err != nil {
		return "", false
	}
	name, ok := networkFileSystems[t&0xffffffff]
	if !ok {
		return "", false
	}
	return "a network file system (" + name + ")", true
}
