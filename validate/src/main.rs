//! `vramsim-validate`: see [`vramsim_validate::cli`].

fn main() -> std::process::ExitCode {
    vramsim_validate::cli::main()
}
