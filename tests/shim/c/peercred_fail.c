/*
 * Preloaded after the shim: getsockopt(SO_PEERCRED) fails (EOPNOTSUPP), so
 * that a test sees what the shim says of a connection whose peer it cannot
 * name. Every other getsockopt goes to the kernel as the C library's would
 * (the system call itself: a dlsym(RTLD_NEXT) lookup can come back here
 * under a sanitizer's interceptors).
 */
#include <errno.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

__attribute__((visibility("default"))) int getsockopt(int fd, int level, int name, void *value,
                                                      socklen_t *len)
{
    if (level == SOL_SOCKET && name == SO_PEERCRED) {
        errno = EOPNOTSUPP;
        return -1;
    }
    return (int)syscall(SYS_getsockopt, fd, level, name, value, len);
}
