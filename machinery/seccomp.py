"""Stands in for libseccomp (a C library, no wheel here): the filter in readable Python, tested (tests/test_sandbox).

A seccomp filter for sandbox.py: a classic-BPF program, built here in readable Python, that makes a few system
calls fail with EPERM; machinery/isolation.py's launcher installs it just before the snippet's exec.

Why each call is refused is in machinery/isolation.py's docstring (the `seccomp` step): AF_UNIX sockets (the
network namespace does not cover path sockets), datagram socketpairs (they can sendto() any path), io_uring (it
makes sockets without a syscall the filter sees), the kernel keyrings (add_key, keyctl, request_key: keyrings are not
namespaced, so a snippet could read or plant keys of the trainer's session or of a uid that outlives the run; Docker
refuses them for this reason), memory that no limit counts (memfd_create and memfd_secret, bounded only by the
file-size limit per memfd; SysV shm, message queues and semaphores, whose limits the kernel lets only a privileged
caller set; Python's multiprocessing uses POSIX shm in /dev/shm, a size-capped tmpfs), every syscall of another ABI.
"""
import os
import struct

# The syscall numbers that the filter and machinery/isolation.py's launcher need, for each ABI.
_AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
_SYSCALL_NR = {"x86_64": {"socket": 41, "socketpair": 53, "add_key": 248, "request_key": 249, "keyctl": 250,
                          "memfd_create": 319, "shmget": 29, "semget": 64, "msgget": 68, "io_uring_setup": 425,
                          "memfd_secret": 447, "pivot_root": 155},
               "aarch64": {"socket": 198, "socketpair": 199, "add_key": 217, "request_key": 218, "keyctl": 219,
                           "memfd_create": 279, "shmget": 194, "semget": 190, "msgget": 186, "io_uring_setup": 425,
                           "memfd_secret": 447, "pivot_root": 41}}
_REFUSED = ("add_key", "request_key", "keyctl", "memfd_create", "memfd_secret", "shmget", "semget", "msgget",
            "io_uring_setup")
SYSCALLS = _SYSCALL_NR.get(os.uname().machine, {})  # for the launcher's own calls


def seccomp_program() -> bytes | None:
    """The filter as a classic-BPF program (struct sock_filter[]); None on an architecture we have no numbers for."""
    machine = os.uname().machine
    if machine not in _AUDIT_ARCH:
        return None
    nr, af_unix, sock_stream = _SYSCALL_NR[machine], 1, 1  # AF_UNIX and SOCK_STREAM on both architectures
    ld, jeq, jge, and_, ret = 0x20, 0x15, 0x35, 0x54, 0x06  # BPF_LD|W|ABS, JMP|JEQ|K, JMP|JGE|K, ALU|AND|K, RET|K
    # (code, k, jump if true, jump if false): a jump names a label (a string in the list), None is the next one.
    # Offsets into struct seccomp_data: nr 0, arch 4, args[i] 16 + 8 i; an argument's low 32 bits are what the
    # kernel reads for an int, so socket(0x100000001, ...) is socket(AF_UNIX, ...) and is caught too.
    program = [(ld, 4, None, None), (jeq, _AUDIT_ARCH[machine], None, "deny"),  # another ABI: i386, arm32
               (ld, 0, None, None), (jge, 0x40000000, "deny", None),  # the x32 ABI (that bit set) on x86_64
               *((jeq, nr[name], "deny", None) for name in _REFUSED),
               (jeq, nr["socket"], "socket", None), (jeq, nr["socketpair"], "socketpair", "allow"),
               "socket", (ld, 16, None, None), (jeq, af_unix, "deny", "allow"),
               "socketpair", (ld, 16, None, None), (jeq, af_unix, None, "allow"),
               (ld, 24, None, None), (and_, 0xF, None, None), (jeq, sock_stream, "allow", "deny"),  # flags aside
               "allow", (ret, 0x7FFF0000, None, None),  # SECCOMP_RET_ALLOW
               "deny", (ret, 0x00050000 | 1, None, None)]  # SECCOMP_RET_ERRNO | EPERM
    labels, ops = {}, []
    for item in program:
        if isinstance(item, str):
            labels[item] = len(ops)
        else:
            ops.append(item)

    def jump(label, i):  # BPF jumps are forward, relative to the next instruction
        return 0 if label is None else labels[label] - i - 1

    return b"".join(struct.pack("=HBBI", code, jump(jt, i), jump(jf, i), k) for i, (code, k, jt, jf) in enumerate(ops))

