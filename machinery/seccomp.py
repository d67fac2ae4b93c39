"""The sandbox's seccomp filter in readable Python, tested (tests/test_sandbox), in place of libseccomp (a C
library, no wheel here).

A seccomp filter for sandbox.py: a classic-BPF program, built here in readable Python, that makes the system calls a
snippet's namespaces do not cover fail; machinery/isolation.py's launcher installs it just before the snippet's exec.
Docker's default profile is the reference; whatever a kernel's sysctls say, the filter itself refuses (EPERM):
- sockets of any family but AF_INET, AF_INET6 (the run's own network namespace) and NETLINK_ROUTE (its interfaces,
  which getaddrinfo and if_nameindex read): AF_UNIX (the network namespace does not cover path sockets), AF_VSOCK
  (its port space is the whole VM's, and it reaches the hypervisor), other netlink protocols (a uevent socket hears
  the host's devices), AF_PACKET, AF_ALG and the rest; socketpair but of Unix stream sockets (a datagram one can
  sendto() any path); io_uring (it makes sockets without a syscall the filter sees);
- new namespaces (unshare, setns, clone with a CLONE_NEW* flag; clone3, whose flags sit behind a pointer, fails with
  ENOSYS, so that libc falls back to clone): in a user namespace of its own a snippet holds every capability there
  and mounts tmpfs that no limit counts;
- kernel-wide interfaces: perf_event_open, bpf, userfaultfd, syslog (the host's kernel log), the kernel keyrings
  (add_key, keyctl, request_key: not namespaced, so a snippet could read or plant keys of the trainer's session or
  of a uid that outlives the run);
- memory that no limit counts (memfd_create and memfd_secret, bounded only by the file-size limit per memfd; SysV
  shm, message queues and semaphores, whose limits the kernel lets only a privileged caller set; Python's
  multiprocessing uses POSIX shm in /dev/shm, a size-capped tmpfs), every syscall of another ABI.
"""
import os
import struct

# The syscall numbers that the filter and machinery/isolation.py's launcher need, for each ABI.
_AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
_SYSCALL_NR = {"x86_64": {"socket": 41, "socketpair": 53, "add_key": 248, "request_key": 249, "keyctl": 250,
                          "memfd_create": 319, "shmget": 29, "semget": 64, "msgget": 68, "io_uring_setup": 425,
                          "memfd_secret": 447, "pivot_root": 155, "unshare": 272, "setns": 308, "clone": 56,
                          "clone3": 435, "perf_event_open": 298, "bpf": 321, "userfaultfd": 323, "syslog": 103},
               "aarch64": {"socket": 198, "socketpair": 199, "add_key": 217, "request_key": 218, "keyctl": 219,
                           "memfd_create": 279, "shmget": 194, "semget": 190, "msgget": 186, "io_uring_setup": 425,
                           "memfd_secret": 447, "pivot_root": 41, "unshare": 97, "setns": 268, "clone": 220,
                           "clone3": 435, "perf_event_open": 241, "bpf": 280, "userfaultfd": 282, "syslog": 116}}
_REFUSED = ("add_key", "request_key", "keyctl", "memfd_create", "memfd_secret", "shmget", "semget", "msgget",
            "io_uring_setup", "unshare", "setns", "perf_event_open", "bpf", "userfaultfd", "syslog")
CLONE_NEW = 0x7E020000  # CLONE_NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET (Docker's mask)
SYSCALLS = _SYSCALL_NR.get(os.uname().machine, {})  # for the launcher's own calls


def seccomp_program() -> bytes | None:
    """The filter as a classic-BPF program (struct sock_filter[]); None on an architecture we have no numbers for."""
    machine = os.uname().machine
    if machine not in _AUDIT_ARCH:
        return None
    nr = _SYSCALL_NR[machine]
    af_unix, af_inet, af_inet6, af_netlink, sock_stream = 1, 2, 10, 16, 1  # the same on both architectures
    ld, jeq, jge, jset, and_, ret = 0x20, 0x15, 0x35, 0x45, 0x54, 0x06  # BPF_LD|W|ABS, JMP|JEQ|K, ..., RET|K
    # (code, k, jump if true, jump if false): a jump names a label (a string in the list), None is the next one.
    # Offsets into struct seccomp_data: nr 0, arch 4, args[i] 16 + 8 i; an argument's low 32 bits are what the
    # kernel reads for an int, so socket(0x100000001, ...) is socket(AF_UNIX, ...) and is caught too.
    program = [(ld, 4, None, None), (jeq, _AUDIT_ARCH[machine], None, "deny"),  # another ABI: i386, arm32
               (ld, 0, None, None), (jge, 0x40000000, "deny", None),  # the x32 ABI (that bit set) on x86_64
               *((jeq, nr[name], "deny", None) for name in _REFUSED), (jeq, nr["clone3"], "enosys", None),
               (jeq, nr["clone"], "clone", None), (jeq, nr["socket"], "socket", None),
               (jeq, nr["socketpair"], "socketpair", "allow"),
               "clone", (ld, 16, None, None), (jset, CLONE_NEW, "deny", "allow"),
               "socket", (ld, 16, None, None), (jeq, af_inet, "allow", None), (jeq, af_inet6, "allow", None),
               (jeq, af_netlink, None, "deny"), (ld, 32, None, None), (jeq, 0, "allow", "deny"),  # NETLINK_ROUTE
               "socketpair", (ld, 16, None, None), (jeq, af_unix, None, "deny"),
               (ld, 24, None, None), (and_, 0xF, None, None), (jeq, sock_stream, "allow", "deny"),  # flags aside
               "allow", (ret, 0x7FFF0000, None, None),  # SECCOMP_RET_ALLOW
               "deny", (ret, 0x00050000 | 1, None, None),  # SECCOMP_RET_ERRNO | EPERM
               "enosys", (ret, 0x00050000 | 38, None, None)]  # | ENOSYS
    labels, ops = {}, []
    for item in program:
        if isinstance(item, str):
            labels[item] = len(ops)
        else:
            ops.append(item)

    def jump(label, i):  # BPF jumps are forward, relative to the next instruction
        return 0 if label is None else labels[label] - i - 1

    return b"".join(struct.pack("=HBBI", code, jump(jt, i), jump(jf, i), k) for i, (code, k, jt, jf) in enumerate(ops))
