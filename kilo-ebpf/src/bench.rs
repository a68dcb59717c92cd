//! The benchmarks' baseline, in an object of its own so the agent never loads it: a classifier
//! that returns at once (the cost of the TC hook and of BPF_PROG_TEST_RUN themselves).
#![no_std]
#![no_main]

use aya_ebpf::{bindings::TC_ACT_OK, macros::classifier, programs::TcContext};

#[classifier]
pub fn kilo_noop(_ctx: TcContext) -> i32 {
    TC_ACT_OK as i32
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 4] = *b"GPL\0";
