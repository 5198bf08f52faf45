/* The pod sandbox's process in carve's real-cluster suite (no registry can
 * serve registry.k8s.io/pause here). What a sandbox process must do, as
 * containerd and the kubelet use it: hold the pod's namespaces open by
 * blocking, reap the zombies of processes that share its PID namespace, and
 * exit 0 on SIGINT or SIGTERM. Built static (gcc -static) so the image needs
 * nothing else. */
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

static void quit(int sig) {
    (void)sig;
    _exit(0);
}

static void reap(int sig) {
    (void)sig;
    while (waitpid(-1, NULL, WNOHANG) > 0) {
    }
}

int main(void) {
    struct sigaction stop = {.sa_handler = quit};
    struct sigaction child = {.sa_handler = reap, .sa_flags = SA_NOCLDSTOP | SA_RESTART};
    if (sigaction(SIGINT, &stop, NULL) < 0 || sigaction(SIGTERM, &stop, NULL) < 0 ||
        sigaction(SIGCHLD, &child, NULL) < 0) {
        return 1;
    }
    for (;;) {
        pause();
    }
}
